"""``python -m db``: query, export, import and upgrade the plan registry.

    python -m db best --seq-len 4096 --head-dim 128 [--nearest] [--json]
    python -m db list [--json]
    python -m db history [--seq-len N --head-dim D] [--limit 20] [--json]
    python -m db export plans.json
    python -m db import plans.json
    python -m db upgrade [--url URL]

Every subcommand takes ``--url`` (default: ``plans.sqlite`` in the per-user data
directory, ``$FLASH_ATTENTION_TUNER_DATA_DIR`` or ``~/.local/share/flash-attention-tuner``,
see ``tuner.data_dir``; the tuner writes there by default). Queries open the registry read-only. A
database at an older schema revision is refused, by readers and writers, until
``upgrade`` is run on it. Exit status: 0 ok, 1 error (one line on stderr, never
a traceback), 2 usage error, 3 ``best`` found no plan (``--json`` prints null).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

from db import transfer
from db.records import StoredPlan
from db.registry import PlanRegistry, upgrade_registry
from tuner.data_dir import default_registry_url
from tuner.environment import Environment
from tuner.errors import TunerError
from tuner.problem import (
    FLOAT32_PRECISIONS,
    SUPPORTED_DTYPES,
    Problem,
    serving_error,
    shape_error,
)

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line too (argparse prints the whole usage by default)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    common = _OneLineParser(add_help=False)
    default_url = default_registry_url()
    common.add_argument(
        "--url", default=default_url, help=f"SQLAlchemy URL (default {default_url})"
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")

    shape = _OneLineParser(add_help=False)
    shape.add_argument("--seq-len", type=_positive)
    shape.add_argument("--head-dim", type=_positive)
    shape.add_argument("--batch", type=_positive, default=1)
    shape.add_argument("--heads", type=_positive, default=1)
    shape.add_argument("--causal", action="store_true")
    shape.add_argument("--dtype", choices=SUPPORTED_DTYPES, default="bfloat16")
    shape.add_argument("--kv-heads", type=_positive, help="KV heads (GQA; default: --heads)")
    shape.add_argument("--kv-len", type=_positive, help="key/value length (default: --seq-len)")
    shape.add_argument(
        "--precision",
        choices=FLOAT32_PRECISIONS,
        help="float32 only: tf32x3 (the default) or tf32 (one-pass TF32 plans)",
    )
    shape.add_argument(
        "--page-size",
        type=_positive,
        help="a serving bucket's KV-cache page size in tokens (default: contiguous)",
    )
    shape.add_argument(
        "--lengths",
        default="equal",
        help="a serving bucket's length distribution: equal (default), uniform, skewed",
    )
    shape.add_argument(
        "--gpu-name",
        help="restrict to environments with this GPU (and the fields below, where given)",
    )
    shape.add_argument("--compute-capability", default="")
    shape.add_argument("--sm-count", type=int, default=0)
    shape.add_argument("--driver-version", default="")
    shape.add_argument("--cuda-version", default="")
    shape.add_argument("--nvcc-version", default="")
    shape.add_argument("--pycuda-version", default="")

    hashes = _OneLineParser(add_help=False)
    hashes.add_argument(
        "--source-hash",
        action="append",
        default=[],
        metavar="FAMILY=HASH",
        help="current kernel source hash; measured plans under another hash are stale",
    )

    parser = _OneLineParser(
        prog="python -m db", description="Query, export, import and upgrade the plan registry."
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    best = commands.add_parser(
        "best", parents=[common, shape, hashes], help="the plan served for a shape"
    )
    best.add_argument("--nearest", action="store_true", help="fall back to the nearest shape")
    listing = commands.add_parser(
        "list", parents=[common, hashes], help="the best plan of every shape"
    )
    listing.add_argument(
        "--dtype", choices=SUPPORTED_DTYPES, help="only shapes of this dtype (default: all)"
    )
    history = commands.add_parser(
        "history", parents=[common, shape, hashes], help="recorded plans, newest first"
    )
    history.add_argument("--limit", type=_positive, default=20)
    export = commands.add_parser("export", parents=[common], help="write every plan as JSON")
    export.add_argument("path")
    import_ = commands.add_parser(
        "import", parents=[common, hashes], help="add the plans of an export (idempotent)"
    )
    import_.add_argument("path")
    commands.add_parser(
        "upgrade",
        parents=[common],
        help="create the database, or migrate it to the newest schema revision",
    )
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def _problem(args: argparse.Namespace, *, required: bool) -> Problem | None:
    if args.seq_len is None and args.head_dim is None and not required:
        return None
    if args.seq_len is None or args.head_dim is None:
        raise TunerError("a problem needs both --seq-len and --head-dim")
    reason = shape_error(args.seq_len, args.heads, args.causal, args.kv_heads, args.kv_len)
    if reason:
        raise TunerError(f"not a problem: {reason}")
    if args.precision is not None and args.dtype != "float32":
        raise TunerError(f"--precision {args.precision} applies to --dtype float32 only")
    reason = serving_error(args.page_size, args.lengths, args.kv_len or args.seq_len)
    if reason:
        raise TunerError(f"not a problem: {reason}")
    return Problem(
        args.seq_len,
        args.head_dim,
        args.batch,
        args.heads,
        args.causal,
        args.dtype,
        kv_heads=args.kv_heads,
        kv_len=args.kv_len,
        precision=args.precision or "",
        page_size=args.page_size,
        lengths=args.lengths,
    )


def _environment(args: argparse.Namespace) -> dict[str, object] | None:
    """The environment fields given on the command line; a plan matches on those only.

    Says on stderr which fields it matches on (stdout stays the answer, or JSON).
    """
    given: dict[str, object] = {
        name: getattr(args, name)
        for name in (f.name for f in fields(Environment))
        if getattr(args, name) not in (None, "", 0)
    }
    if not given:
        return None
    shown = ", ".join(f"{name}={value!r}" for name, value in given.items())
    rest = len(fields(Environment)) - len(given)
    note = f"; the other {rest} fields: any" if rest else ""
    print(f"matching environments on {shown}{note}", file=sys.stderr)
    return given


def _source_hashes(args: argparse.Namespace) -> Mapping[str, str] | None:
    pairs = {}
    for item in args.source_hash:
        family, sep, digest = item.partition("=")
        if not sep or not family:
            raise TunerError(f"--source-hash wants FAMILY=HASH, got {item!r}")
        pairs[family] = digest
    return pairs or None


def _summary(stored: StoredPlan) -> str:
    record = stored.record
    if stored.served_as_measured:
        timing = f"measured {record.median_ms:.4g} ms"
    elif record.measured:
        timing = f"STALE source (measured {record.median_ms:.4g} ms under {record.source_hash})"
    else:
        timing = f"predicted {record.ranking_ms:.4g} ms"
    params = " ".join(f"{k}={v}" for k, v in sorted(record.params.items()))
    note = " [nearest shape]" if stored.fallback else ""
    return (
        f"#{stored.plan_id} {stored.problem.label()} on {stored.environment.gpu_name}: "
        f"{record.family} {params} | {timing}{note}"
    )


def _emit(args: argparse.Namespace, plans: Sequence[StoredPlan]) -> None:
    if args.json:
        print(json.dumps([transfer.stored_to_dict(p) for p in plans], indent=1))
    else:
        for stored in plans:
            print(_summary(stored))


def run(args: argparse.Namespace) -> int:
    if args.command == "upgrade":
        before, after = upgrade_registry(args.url)
        result: dict[str, Any] = {"url": args.url, "from": before, "to": after}
        print(json.dumps(result) if args.json else f"{args.url}: {before or 'new'} -> {after}")
        return 0
    if args.command == "import":
        # Read (and checked) first: a missing or malformed export creates no registry.
        entries = transfer.read_export(Path(args.path))
        hashes = _source_hashes(args)
        with PlanRegistry.open(args.url) as registry:
            summary = registry.import_(args.path, source_hashes=hashes, entries=entries)
        result = {"added": summary.added, "skipped": summary.skipped}
        print(
            json.dumps(result)
            if args.json
            else f"added {summary.added}, skipped {summary.skipped} already present"
        )
        return 0
    with PlanRegistry.open(args.url, readonly=True) as registry:
        if args.command == "export":
            count = registry.export(args.path)
            print(json.dumps({"exported": count}) if args.json else f"exported {count} plans")
            return 0
        hashes = _source_hashes(args)
        if args.command == "best":
            problem = _problem(args, required=True)
            assert problem is not None
            stored = registry.best(
                problem, _environment(args), nearest=args.nearest, source_hashes=hashes
            )
            if stored is None:
                print(json.dumps(None) if args.json else f"no plan for {problem.label()}")
                return EXIT_NOT_FOUND
            if args.json:
                print(json.dumps(transfer.stored_to_dict(stored), indent=1))
            else:
                print(_summary(stored))
            return 0
        if args.command == "list":
            plans = registry.list_best(source_hashes=hashes)
            if args.dtype is not None:
                plans = [plan for plan in plans if plan.problem.dtype == args.dtype]
            _emit(args, plans)
            return 0
        problem = _problem(args, required=False)
        _emit(
            args,
            registry.history(problem, _environment(args), limit=args.limit, source_hashes=hashes),
        )
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except TunerError as e:
        print(f"python -m db {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
