"""agent enrolments

A launched task carries a single-use enrolment token instead of the attempt's agent
token (SkyPilot keeps task secrets in plaintext in its request database); each node
exchanges it once, at its first register, and the exchange is a row of
``agent_enrolments`` (the token's sha256 and the node), so a replay is refused.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 21:45:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('agent_enrolments',
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('node_id', sa.String(length=64), nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('used_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_agent_enrolments_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('token_hash', 'node_id', name=op.f('pk_agent_enrolments'))
    )
    with op.batch_alter_table('agent_enrolments', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_agent_enrolments_job_id'), ['job_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('agent_enrolments', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_agent_enrolments_job_id'))

    op.drop_table('agent_enrolments')
