"""protocol step results

What a protocol step decided (the confirmed checkpoint, the chosen placement) is
kept with the step, so the steps after it read it from the step instead of finding
an event by a rebuilt key.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 09:10:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('protocol_steps', schema=None) as batch_op:
        batch_op.add_column(sa.Column('result', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('protocol_steps', schema=None) as batch_op:
        batch_op.drop_column('result')
