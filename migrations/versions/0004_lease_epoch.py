"""lease epoch

The reconciler lease gets an epoch: it grows by one each time the lease changes
holder, and every write that starts, stops or commands a node checks it (a fencing
token), so a leader that was paused past its lease can never act again.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 14:40:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.add_column(
            sa.Column('epoch', sa.Integer(), nullable=False, server_default='0')
        )


def downgrade() -> None:
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.drop_column('epoch')
