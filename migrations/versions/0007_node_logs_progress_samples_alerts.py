"""node logs, progress samples, alert webhooks and the alert outbox

``node_logs`` keeps the last lines each agent uploaded (a dead node's too);
``progress_samples`` is the run's time series (step, step time, loss, grad norm per
rank); ``alert_webhooks`` and ``alert_outbox`` queue each alert before it is sent, so
a service restart loses none and a (event, target) pair is queued once.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 00:52:14
"""

from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('alert_outbox',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('event_key', sa.String(length=128), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('target', sa.String(length=128), nullable=False),
    sa.Column('url', sa.Text(), nullable=False),
    sa.Column('body', sa.JSON(), nullable=False),
    sa.Column('tries', sa.Integer(), nullable=False),
    sa.Column('next_try_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_alert_outbox_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_alert_outbox')),
    sa.UniqueConstraint('event_key', 'target', name=op.f('uq_alert_outbox_event_key'))
    )
    with op.batch_alter_table('alert_outbox', schema=None) as batch_op:
        batch_op.create_index('ix_alert_outbox_due', ['delivered_at', 'next_try_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_alert_outbox_job_id'), ['job_id'], unique=False)

    op.create_table('alert_webhooks',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=True),
    sa.Column('url', sa.Text(), nullable=False),
    sa.Column('secret', sa.String(length=256), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_alert_webhooks_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_alert_webhooks'))
    )
    with op.batch_alter_table('alert_webhooks', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_alert_webhooks_job_id'), ['job_id'], unique=False)

    op.create_table('node_logs',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('node_id', sa.String(length=64), nullable=False),
    sa.Column('source', sa.String(length=32), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=True),
    sa.Column('lines', sa.Text(), nullable=False),
    sa.Column('reason', sa.String(length=16), nullable=False),
    sa.Column('uploaded_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_node_logs_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_node_logs')),
    sa.UniqueConstraint('job_id', 'attempt', 'node_id', 'source', name=op.f('uq_node_logs_job_id'))
    )
    with op.batch_alter_table('node_logs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_node_logs_job_id'), ['job_id'], unique=False)

    op.create_table('progress_samples',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('node_id', sa.String(length=64), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('step_time', sa.Float(), nullable=True),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('grad_norm', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_progress_samples_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_progress_samples'))
    )
    with op.batch_alter_table('progress_samples', schema=None) as batch_op:
        batch_op.create_index('ix_progress_samples_job_at', ['job_id', 'at'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('progress_samples', schema=None) as batch_op:
        batch_op.drop_index('ix_progress_samples_job_at')

    op.drop_table('progress_samples')
    with op.batch_alter_table('node_logs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_node_logs_job_id'))

    op.drop_table('node_logs')
    with op.batch_alter_table('alert_webhooks', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_alert_webhooks_job_id'))

    op.drop_table('alert_webhooks')
    with op.batch_alter_table('alert_outbox', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_alert_outbox_job_id'))
        batch_op.drop_index('ix_alert_outbox_due')

    op.drop_table('alert_outbox')
