"""``python -m db``: query, export, import and upgrade the plan registry.

    python -m db best --seq-len 4096 --head-dim 128 [--nearest] [--json]
    python -m db best --seq-len 16384 --head-dim 128 --causal --window-left 4096 --softcap 50
    python -m db list [--json] [--dtype D] [--window-left N] [--softcap X] [--alibi] [--plain]
    python -m db history [--seq-len N --head-dim D] [--limit 20] [--json]
    python -m db export plans.json     (or - for standard output)
    python -m db import plans.json
    python -m db upgrade [--url URL]
    python -m db verify [--threshold 1.25] [--dtype D] [--json]   (on a GPU)

Every subcommand takes ``--url`` (default: ``plans.sqlite`` in the per-user data
directory, ``$FLASH_ATTENTION_TUNER_DATA_DIR`` or ``~/.local/share/flash-attention-tuner``,
see ``tuner.data_dir``; the tuner writes there by default). Queries open the registry read-only. A
database at an older schema revision is refused, by readers and writers, until
``upgrade`` is run on it. Exit status: 0 ok, 1 error (one line on stderr, never
a traceback), 2 usage error, 3 ``best`` found no plan (``--json`` prints null),
141 the reader of stdout went away (``| head -1``; quiet, as Unix tools).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

from db import transfer
from db.export_target import is_standard_output
from db.records import StoredPlan
from db.registry import PlanRegistry, upgrade_registry
from db.verification import (
    DEFAULT_THRESHOLD,
    Measuring,
    Verdict,
    gpu_measuring,
    table,
    verify,
)
from tuner.broken_pipe import quiet_exit_status
from tuner.data_dir import default_registry_url
from tuner.environment import Environment
from tuner.errors import TunerError
from tuner.problem import (
    DIRECTIONS,
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
        "--window-left",
        type=_window_bound,
        default=-1,
        help="sliding window: keys a row sees before its diagonal (-1, the default: no bound)",
    )
    shape.add_argument(
        "--window-right",
        type=_window_bound,
        default=-1,
        help="sliding window: keys a row sees after its diagonal (-1, the default: no bound)",
    )
    shape.add_argument(
        "--softcap", type=_softcap, default=0.0, help="logit softcap (0, the default: none)"
    )
    shape.add_argument("--alibi", action="store_true", help="ALiBi biases")
    shape.add_argument("--sinks", action="store_true", help="attention sinks")
    shape.add_argument(
        "--direction",
        choices=DIRECTIONS,
        default="forward",
        help="forward (the attention) or backward (its gradients)",
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
    listing.add_argument(
        "--window-left", type=_window_bound, help="only shapes with this window_left (-1: none)"
    )
    listing.add_argument(
        "--window-right", type=_window_bound, help="only shapes with this window_right (-1: none)"
    )
    listing.add_argument("--softcap", type=_softcap, help="only shapes with this softcap (0: none)")
    listing.add_argument("--alibi", action="store_true", help="only shapes with ALiBi")
    listing.add_argument("--sinks", action="store_true", help="only shapes with sinks")
    listing.add_argument(
        "--plain", action="store_true", help="only shapes without any variant"
    )
    history = commands.add_parser(
        "history", parents=[common, shape, hashes], help="recorded plans, newest first"
    )
    history.add_argument("--limit", type=_positive, default=20)
    export = commands.add_parser("export", parents=[common], help="write every plan as JSON")
    export.add_argument("path", help="a file (a link writes its target), or - for stdout")
    import_ = commands.add_parser(
        "import", parents=[common, hashes], help="add the plans of an export (idempotent)"
    )
    import_.add_argument("path")
    commands.add_parser(
        "upgrade",
        parents=[common],
        help="create the database, or migrate it to the newest schema revision",
    )
    verify = commands.add_parser(
        "verify",
        parents=[common, hashes],
        help="re-measure this GPU's stored plans; disable those that fail or got slower",
    )
    verify.add_argument(
        "--dtype", choices=SUPPORTED_DTYPES, help="only shapes of this dtype (default: all)"
    )
    verify.add_argument(
        "--threshold",
        type=_above_one,
        default=DEFAULT_THRESHOLD,
        help="disable a plan this many times slower than its stored time "
        f"(default {DEFAULT_THRESHOLD})",
    )
    return parser


def _above_one(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 1 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number above 1")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def _window_bound(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < -1:
        raise argparse.ArgumentTypeError(f"{value} is neither >= 0 nor -1 (no bound)")
    return value


def _softcap(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number >= 0 (0: no cap)")
    return value


def _listed(args: argparse.Namespace, problem: Problem) -> bool:
    """Whether ``list``'s filters keep a shape: each filter given must match."""
    wanted = {
        "dtype": args.dtype,
        "window_left": args.window_left,
        "window_right": args.window_right,
        "softcap": args.softcap,
        "alibi": args.alibi or None,
        "sinks": args.sinks or None,
    }
    if args.plain and problem.has_variant:
        return False
    return all(value is None or getattr(problem, name) == value for name, value in wanted.items())


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
        window_left=args.window_left,
        window_right=args.window_right,
        softcap=args.softcap,
        alibi=args.alibi,
        sinks=args.sinks,
        direction=args.direction,
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


def run(args: argparse.Namespace, measuring: Callable[[], Measuring] | None = None) -> int:
    if args.command == "verify":
        return _verify(args, measuring or gpu_measuring)
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
            on_stdout = is_standard_output(args.path)  # before: the export may create the file
            count = registry.export(args.path)
            summary = json.dumps({"exported": count}) if args.json else f"exported {count} plans"
            # With the export on stdout, the summary goes to stderr.
            print(summary, file=sys.stderr if on_stdout else sys.stdout)
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
            _emit(args, [plan for plan in plans if _listed(args, plan.problem)])
            return 0
        problem = _problem(args, required=False)
        _emit(
            args,
            registry.history(problem, _environment(args), limit=args.limit, source_hashes=hashes),
        )
        return 0


def _verify(args: argparse.Namespace, measuring: Callable[[], Measuring]) -> int:
    """Exit 0 when every plan verified passed, 1 when any was disabled (or on an error)."""
    hashes = _source_hashes(args)
    # The registry must exist and be one (a read-only open creates nothing) before the GPU
    # is started; without a GPU the command is one error line and changes nothing.
    PlanRegistry.open(args.url, readonly=True).close()
    measured = measuring()
    try:
        with PlanRegistry.open(args.url) as registry:
            verdicts = verify(
                registry,
                measured.backend,
                measured.device,
                measured.environment,
                threshold=args.threshold,
                dtype=args.dtype,
                source_hashes=hashes,
                prepare=measured.prepare,
            )
    finally:
        measured.backend.close()
    if args.json:
        print(json.dumps([_verdict_dict(v) for v in verdicts], indent=1))
    else:
        print(table(verdicts))
    disabled = [v for v in verdicts if not v.ok]
    if disabled:
        print(
            f"python -m db verify: {len(disabled)} of {len(verdicts)} plans disabled on "
            f"{measured.environment.gpu_name}",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return 0


def _verdict_dict(verdict: Verdict) -> dict[str, Any]:
    return {
        "plan_id": verdict.stored.plan_id,
        "problem": verdict.stored.problem.label(),
        "plan": verdict.key,
        "stored_ms": verdict.stored_ms,
        "now_ms": verdict.now_ms,
        "drift": verdict.drift,
        "failure": verdict.failure,
        "disabled": verdict.disabled,
    }


def main(
    argv: Sequence[str] | None = None, *, measuring: Callable[[], Measuring] | None = None
) -> int:
    """``measuring``: what ``verify`` measures with (default: this GPU, ``gpu_measuring``)."""
    args = build_parser().parse_args(argv)
    try:
        return run(args, measuring)
    except TunerError as e:
        print(f"python -m db {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        # ``python -m db list | head -1``: the reader has gone; quiet, as a Unix tool.
        return quiet_exit_status()
