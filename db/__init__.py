"""Plan registry: the best kernel plan per problem x environment, in SQLAlchemy.

Public API: ``PlanRegistry`` (open / record / best / cached_best / history /
list_best / export / import_), the value types ``PlanRecord``, ``StoredPlan``,
``RecordOutcome``, ``RecordStatus``, ``ImportSummary``, the ``BestPlanCache``
LRU, ``upgrade_registry`` and ``default_registry_url`` (``plans.sqlite`` in the per-user
data directory, see ``tuner.data_dir``). CLI: ``python -m db --help``.
"""

from db.cache import BestPlanCache
from db.records import ImportSummary, PlanRecord, RecordOutcome, RecordStatus, StoredPlan
from db.registry import PlanRegistry, upgrade_registry
from tuner.data_dir import default_registry_url

__all__ = [
    "BestPlanCache",
    "ImportSummary",
    "PlanRecord",
    "PlanRegistry",
    "RecordOutcome",
    "RecordStatus",
    "StoredPlan",
    "default_registry_url",
    "upgrade_registry",
]
