"""Where a study lives and what it is called.

A study holds the trials of one problem in one environment against one
version of the kernel sources, proposed by one sampler: its name is built from
all four, so re-running the same command continues it, while a new GPU, driver
or toolchain, or an edited ``.cu`` file, starts a fresh study (old timings say
nothing about the new kernel), and so does another ``search.sampler`` (its
trials encode the space differently, and a comparison of samplers needs each
to start from nothing). The name stays readable (problem, GPU, sampler) with a
short digest of the environment and the sources.

The default storage is ``studies.sqlite`` next to the registry's SQLite file;
open it with ``optuna-dashboard sqlite:///path/to/studies.sqlite``. A registry
on a server (PostgreSQL) gets ``studies.sqlite`` in the per-user data directory
(``tuner.data_dir``) unless ``search.storage`` names one: the registry's own
tables (and its ``alembic_version``) must not share a schema with Optuna's.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from tuner.data_dir import STUDIES_FILE, default_studies_url
from tuner.environment import Environment
from tuner.errors import ConfigError
from tuner.problem import UNBOUNDED, Problem


def study_name(
    problem: Problem,
    environment: Environment,
    source_hashes: Mapping[str, str],
    variant: str = "",
    *,
    sampler: str = "tpe",
) -> str:
    """``<batch>x<heads>x<seq_len>x<head_dim>-<dtype>[-tf32]-<mask>[-backward][-page<n>][-<lengths>][-<variants>]@<gpu>-<digest>-<sampler>[-<variant>]``.

    With GQA the heads read ``<heads>kv<kv_heads>``, with a KV length the rows
    ``<seq_len>kv<kv_len>``, a backward problem's mask ``<mask>-backward``; a serving bucket
    adds its page size and length distribution; the attention variants follow
    (``variant_suffix``: ``-w4096-cap50-alibi-sinks``). A plain forward problem keeps the name
    it always had.

    ``variant`` keeps studies of the same identity apart (``replay``: timings
    served from a recording must not continue the GPU study they came from).
    """
    identity = {
        "environment": environment.as_dict(),
        "sources": dict(sorted(source_hashes.items())),
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", environment.gpu_name).strip("-").lower() or "gpu"
    mask = "causal" if problem.causal else "full"
    if problem.backward:  # forward studies keep the names they had
        mask += "-backward"
    shape = problem.shape_text(heads_separator="kv", rows_separator="kv")
    serving = problem.serving_text(separator="-").replace("page=", "page").replace("lengths=", "")
    mask = f"{mask}-{serving}" if serving else mask
    name = f"{shape}-{problem.dtype_label}-{mask}{variant_suffix(problem)}@{gpu}-{digest}-{sampler}"
    return f"{name}-{variant}" if variant else name


def variant_suffix(problem: Problem) -> str:
    """The attention variants in a study name: ``-w<window_left>`` and ``-wr<window_right>``
    for the window's bounds, ``-cap<softcap>``, ``-alibi``, ``-sinks``; "" for none."""
    parts = []
    if problem.window_left != UNBOUNDED:
        parts.append(f"w{problem.window_left}")
    if problem.window_right != UNBOUNDED:
        parts.append(f"wr{problem.window_right}")
    if problem.softcap > 0:
        parts.append(f"cap{problem.softcap:g}")
    parts += [name for name in ("alibi", "sinks") if getattr(problem, name)]
    return "".join(f"-{part}" for part in parts)


def default_storage_url(registry_url: str) -> str:
    """``sqlite:///<registry directory>/studies.sqlite``, or the data directory's."""
    try:
        url = make_url(registry_url)
    except ArgumentError as error:
        raise ConfigError(f"registry.url={registry_url} is invalid: {error}") from error
    database = url.database
    if url.get_backend_name() == "sqlite" and database and database != ":memory:":
        path = Path(database).expanduser().parent / STUDIES_FILE
    else:
        return default_studies_url()
    return f"sqlite:///{path}"
