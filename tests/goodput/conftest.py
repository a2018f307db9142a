"""The goodput tests' session: one per test on each backend (``db_url``), committed at
the end. ``goodput_history.reread`` makes what a test reads next come from the
database rather than from the objects it built."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy.orm import Session

from orchestrator.store.db import make_engine, make_sessionmaker


@pytest.fixture
def session(db_url: str) -> Iterator[Session]:
    engine = make_engine(db_url)
    with make_sessionmaker(engine)() as s:
        yield s
        s.commit()
    engine.dispose()
