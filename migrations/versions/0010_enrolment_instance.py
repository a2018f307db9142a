"""agent_enrolments.instance_hash: the enrolling agent process's own id, so that its
register retried after a lost answer is answered again instead of refused as a replay

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06 10:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable: an enrolment spent before this revision names no agent process, and a
    # second register with its token stays a replay.
    with op.batch_alter_table('agent_enrolments', schema=None) as batch_op:
        batch_op.add_column(sa.Column('instance_hash', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('agent_enrolments', schema=None) as batch_op:
        batch_op.drop_column('instance_hash')
