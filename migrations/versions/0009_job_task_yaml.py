"""jobs.task_yaml: a SkyPilot task's text, stored with its job at submit

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05 10:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable: a template job has none, and a job stored before this revision keeps
    # reading its task from the path in its spec.
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('task_yaml', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('task_yaml')
