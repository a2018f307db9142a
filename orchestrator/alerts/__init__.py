"""Alerts: webhooks on incident opened/closed and job failed/succeeded.

* :mod:`.events` detects the events from the store (pure of its session: it reads);
* :mod:`.outbox` queues one row per (event, webhook) and delivers them, signed, with
  backoff, so a restart loses none and queues none twice;
* :mod:`.loop` is the service's operator loop that runs both (and samples progress).
"""
