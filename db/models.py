"""Tables of the plan registry (SQLAlchemy 2.x typed declarative models).

Four tables: ``environments`` and ``problems`` (one row per identity, unique),
``plans`` (every recorded plan, kept as history) and ``best_plans`` (the best
pointer per problem x environment; its primary key makes ``best()`` one
indexed lookup). The schema is created and changed only by the Alembic
migrations in ``db/migrations/versions``; a test checks that these models and
the migrations' result agree.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Select,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    bindparam,
    false,
    select,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from tuner.environment import Environment
from tuner.problem import Problem

# Deterministic constraint names: SQLite's batch migrations recreate tables and
# can only drop or re-create a constraint they can name.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

_U64_SPAN = 1 << 64
_I64_MAX = (1 << 63) - 1


class UnsignedBigInteger(TypeDecorator[int]):
    """A u64 in a signed 64-bit column, by two's complement reinterpretation.

    The planner's traffic figures use saturating u64 arithmetic, so
    ``2**64 - 1`` is a legitimate value, but SQLite and PostgreSQL integers are
    signed 64-bit. Reinterpreting keeps every u64 exact (ordering in SQL is not
    needed for these columns).
    """

    impl = BigInteger
    cache_ok = True

    def process_bind_param(self, value: int | None, dialect: Dialect) -> int | None:
        if value is None:
            return None
        if not 0 <= value < _U64_SPAN:
            raise ValueError(f"{value} is not an unsigned 64-bit integer")
        return value - _U64_SPAN if value > _I64_MAX else value

    def process_result_value(self, value: int | None, dialect: Dialect) -> int | None:
        if value is None:
            return None
        return value + _U64_SPAN if value < 0 else value


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in, aware UTC datetimes out.

    SQLite has no time zones; storing naive UTC and re-attaching UTC on the way
    out makes every backend return the same value that was written.
    """

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("created_at must be timezone-aware (UTC)")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def problem_identity(problem: Problem) -> dict[str, int | bool | str | float]:
    return {
        "seq_len": problem.seq_len,
        "head_dim": problem.head_dim,
        "batch": problem.batch,
        "heads": problem.heads,
        "causal": problem.causal,
        "dtype": problem.dtype,
        "kv_heads": problem.kv_heads,
        "kv_len": problem.kv_len,
        "precision": problem.precision,
        "window_left": problem.window_left,
        "window_right": problem.window_right,
        "softcap": problem.softcap,
        "alibi": problem.alibi,
        "sinks": problem.sinks,
        "direction": problem.direction,
        "page_size": problem.page_size or 0,
        "lengths": problem.lengths,
    }


@functools.cache
def _lookup(model: type[EnvironmentRow] | type[ProblemRow]) -> Select[Any]:
    """``SELECT row WHERE <unique key> = :params``, built once per model.

    Building the WHERE clause anew on every call (seven comparisons for an
    environment) cost more than running the query; a reused statement with
    bound parameters also reuses SQLAlchemy's compiled form.
    """
    (unique,) = (c for c in model.__table__.constraints if isinstance(c, UniqueConstraint))
    return select(model).where(*(column == bindparam(column.name) for column in unique.columns))


class EnvironmentRow(Base):
    """Where plans were tuned; one row per distinct GPU + toolchain identity."""

    __tablename__ = "environments"
    __table_args__ = (
        UniqueConstraint(
            "gpu_name",
            "compute_capability",
            "sm_count",
            "driver_version",
            "cuda_version",
            "nvcc_version",
            "pycuda_version",
            name="uq_environments_identity",
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    gpu_name: Mapped[str] = mapped_column(String(128))
    compute_capability: Mapped[str] = mapped_column(String(16))
    sm_count: Mapped[int] = mapped_column(Integer)
    driver_version: Mapped[str] = mapped_column(String(64))
    cuda_version: Mapped[str] = mapped_column(String(64))
    nvcc_version: Mapped[str] = mapped_column(String(64))
    # Added by revision 0002; rows from 0001 databases get "" (unknown).
    pycuda_version: Mapped[str] = mapped_column(String(64), server_default="")

    @classmethod
    def find(cls, session: Session, environment: Environment) -> EnvironmentRow | None:
        return session.scalars(_lookup(cls), environment.as_dict()).one_or_none()

    @classmethod
    def from_environment(cls, environment: Environment) -> EnvironmentRow:
        return cls(**environment.as_dict())

    def to_environment(self) -> Environment:
        return Environment(
            gpu_name=self.gpu_name,
            compute_capability=self.compute_capability,
            sm_count=self.sm_count,
            driver_version=self.driver_version,
            cuda_version=self.cuda_version,
            nvcc_version=self.nvcc_version,
            pycuda_version=self.pycuda_version,
        )


class ProblemRow(Base):
    """One attention shape; one row per distinct shape."""

    __tablename__ = "problems"
    # Column order puts (head_dim, dtype, precision, direction, causal) first so that the same
    # unique index serves both the exact lookup and the nearest-shape candidates.
    __table_args__ = (
        UniqueConstraint(
            "head_dim",
            "dtype",
            "precision",
            "direction",
            "causal",
            "seq_len",
            "batch",
            "heads",
            "kv_heads",
            "kv_len",
            "window_left",
            "window_right",
            "softcap",
            "alibi",
            "sinks",
            "page_size",
            "lengths",
            name="uq_problems_shape",
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq_len: Mapped[int] = mapped_column(Integer)
    head_dim: Mapped[int] = mapped_column(Integer)
    batch: Mapped[int] = mapped_column(Integer)
    heads: Mapped[int] = mapped_column(Integer)
    causal: Mapped[bool] = mapped_column(Boolean)
    dtype: Mapped[str] = mapped_column(String(16))
    # Added by revision 0004 (grouped-query attention, KV caches); rows from
    # before it are self-attention: kv_heads = heads, kv_len = seq_len.
    kv_heads: Mapped[int] = mapped_column(Integer)
    kv_len: Mapped[int] = mapped_column(Integer)
    # Added by revision 0005: "tf32x3" or "tf32" for float32 (rows from before it
    # read as "tf32x3", the accurate precision), "" for the half dtypes.
    precision: Mapped[str] = mapped_column(String(16), server_default="")
    # Added by revision 0006: the attention variants (tuner.problem.Problem); rows from
    # before it are plain attention: no window (-1, -1), no softcap (0), no ALiBi, no sinks.
    window_left: Mapped[int] = mapped_column(Integer, server_default="-1")
    window_right: Mapped[int] = mapped_column(Integer, server_default="-1")
    softcap: Mapped[float] = mapped_column(Double, server_default="0")
    alibi: Mapped[bool] = mapped_column(Boolean, server_default=false())
    sinks: Mapped[bool] = mapped_column(Boolean, server_default=false())
    # Added by revision 0008: "forward" or "backward" (rows from before it read "forward").
    direction: Mapped[str] = mapped_column(String(16), server_default="forward")
    # Added by revision 0009 (serving buckets): tokens a page of a paged KV cache (0:
    # contiguous) and the requests' length distribution; rows from before it are dense
    # problems, 0 and "equal".
    page_size: Mapped[int] = mapped_column(Integer, server_default="0")
    lengths: Mapped[str] = mapped_column(String(1024), server_default="equal")

    @classmethod
    def find(cls, session: Session, problem: Problem) -> ProblemRow | None:
        return session.scalars(_lookup(cls), problem_identity(problem)).one_or_none()

    @classmethod
    def from_problem(cls, problem: Problem) -> ProblemRow:
        return cls(**problem_identity(problem))

    def to_problem(self) -> Problem:
        return Problem(
            seq_len=self.seq_len,
            head_dim=self.head_dim,
            batch=self.batch,
            heads=self.heads,
            causal=self.causal,
            dtype=self.dtype,
            kv_heads=self.kv_heads,
            kv_len=self.kv_len,
            precision=self.precision,
            window_left=self.window_left,
            window_right=self.window_right,
            softcap=self.softcap,
            alibi=self.alibi,
            sinks=self.sinks,
            direction=self.direction,
            page_size=self.page_size or None,
            lengths=self.lengths,
        )


class PlanRow(Base):
    """One recorded plan and its evidence. Never deleted: history. Only ``disabled_reason``
    is ever updated (``db.writes.disable_plan``)."""

    __tablename__ = "plans"
    __table_args__ = (
        # Serves "the fastest current measured plan of this problem x environment",
        # the query used when the best pointer's kernel source has gone stale.
        Index("ix_plans_lookup", "problem_id", "environment_id", "measured", "median_ms"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    problem_id: Mapped[int] = mapped_column(ForeignKey("problems.id"))
    environment_id: Mapped[int] = mapped_column(ForeignKey("environments.id"))
    family: Mapped[str] = mapped_column(String(64))
    params: Mapped[str] = mapped_column(Text)  # JSON object, keys sorted
    source_hash: Mapped[str] = mapped_column(String(128))
    measured: Mapped[bool] = mapped_column(Boolean)
    median_ms: Mapped[float | None] = mapped_column(Double)
    spread_ms: Mapped[float | None] = mapped_column(Double)
    tflops: Mapped[float | None] = mapped_column(Double)
    gbps: Mapped[float | None] = mapped_column(Double)
    max_abs_error: Mapped[float | None] = mapped_column(Double)
    predicted_ms: Mapped[float | None] = mapped_column(Double)
    predicted_read_bytes: Mapped[int | None] = mapped_column(UnsignedBigInteger)
    predicted_write_bytes: Mapped[int | None] = mapped_column(UnsignedBigInteger)
    study_name: Mapped[str | None] = mapped_column(String(256))
    trial_number: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # Added by revision 0007: why ``python -m db verify`` took the plan out of service;
    # "" (every row from before) means served.
    disabled_reason: Mapped[str] = mapped_column(Text, server_default="")


class BestPlanRow(Base):
    """The best pointer: which plan is served for a problem x environment."""

    __tablename__ = "best_plans"

    problem_id: Mapped[int] = mapped_column(ForeignKey("problems.id"), primary_key=True)
    environment_id: Mapped[int] = mapped_column(ForeignKey("environments.id"), primary_key=True)
    plan_id: Mapped[int] = mapped_column(ForeignKey("plans.id"))
