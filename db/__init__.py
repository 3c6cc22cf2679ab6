"""Plan registry: the best kernel plan per problem x environment, in SQLAlchemy.

Public API: ``PlanRegistry`` (open / record / best / cached_best / history /
list_best / export / import_), the value types ``PlanRecord``, ``StoredPlan``,
``RecordOutcome``, ``RecordStatus``, ``ImportSummary``, the ``BestPlanCache``
LRU, ``upgrade_registry`` and ``DEFAULT_URL``. CLI: ``python -m db --help``.
"""

from db.cache import BestPlanCache
from db.records import ImportSummary, PlanRecord, RecordOutcome, RecordStatus, StoredPlan
from db.registry import PlanRegistry, upgrade_registry
from db.storage import DEFAULT_URL

__all__ = [
    "DEFAULT_URL",
    "BestPlanCache",
    "ImportSummary",
    "PlanRecord",
    "PlanRegistry",
    "RecordOutcome",
    "RecordStatus",
    "StoredPlan",
    "upgrade_registry",
]
