"""job submissions: the Idempotency-Key of each POST /v1/jobs that carried one

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 01:15:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('job_submissions',
    sa.Column('key', sa.String(length=128), nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('spec_sha256', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_submissions_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('key', name=op.f('pk_job_submissions'))
    )
    with op.batch_alter_table('job_submissions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_job_submissions_job_id'), ['job_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('job_submissions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_job_submissions_job_id'))
    op.drop_table('job_submissions')
