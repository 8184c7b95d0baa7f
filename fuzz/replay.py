"""``radixspec replay``: what hit rate would a request trace get with N pages, with this cache?

    radixspec replay TRACE --impl all --pool-pages 256,1024,4096 [--page-size 16]
                          [--target NAME] [--json rows.json] [--plot hit_rate.png]
    radixspec replay --generate trace.jsonl --requests 100000 [--seed 0]
    radixspec replay TRACE --workers 1,2,4,8 --router dynamo,radixspec,round-robin,least-loaded
    radixspec replay TRACE --tiers --pool-pages 256 --host-pages 256,1024,4096 --storage-pages 0,16384

Each request of the trace, in order, goes through the cache the way a
serving engine's cache manager uses it for a prompt: match the prompt, lock
the matched path, take pages for the rest (evicting LRU pages when the pool
is short), insert the whole pages, unlock; the partial last page goes back to
the pool. Per implementation and pool size it prints the token and request
hit rates, the pages evicted and the pages in use (cached) at the end and at
the peak. The spec, the reference and the optimized cache must give the
same numbers (a differential at trace scale: ``--impl all`` checks it).

Trace formats (``--format auto`` tells them apart by the first line):

* JSONL: one request per line, ``{"tokens": [...]}``, optionally
  ``"namespace"`` (a JSON list becomes a tuple, a string ``s`` becomes
  ``(s,)``) and ``"timestamp"`` (requests are replayed in timestamp order,
  ties in file order).
* Mooncake (``hash_ids`` per block of ``--block-size`` tokens, 512 unless
  given, ``input_length``, ``output_length``, ``timestamp``): block ``h``
  stands for the tokens ``h * B ... h * B + B - 1``; the prompt is cut to
  ``input_length``. Output tokens are not replayed (only prompts are cached).
  The FAST'25 traces: github.com/kvcache-ai/Mooncake, ``FAST25-release/traces``.
* Bailian (Alibaba Cloud's Qwen serving traces, USENIX ATC'25: the Mooncake
  fields, blocks of 16 tokens unless ``--block-size`` says otherwise, and
  ``chat_id``, ``parent_chat_id``, ``turn``, ``type``, which the replay does
  not need: a turn's blocks already hold its history). Told apart by
  ``chat_id``. The traces (``qwen_traceA_blksz_16.jsonl``, ``qwen_traceB``,
  ``qwen_coder``, ``qwen_thinking``): github.com/alibaba-edu/qwen-bailian-usagetraces-anon.

``--tiers`` replays through tiered caches (device, host, storage: ``fuzz/tier_replay.py``): the hit rate by
tier against the host and storage sizes, ``--pool-pages`` being the device's.

``--generate`` writes a synthetic JSONL trace: conversations that share one
of a few system prompts, multi-turn chats whose every turn extends the
previous prompt, and few-shot prompts that share their example blocks,
spread over a few tenants (namespaces).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TextIO, TypeVar

from radixspec.spec.domains import TOKEN_LIMIT, Namespace, check_namespace
from radixspec.spec.errors import CacheError

from .pools import Driver, Pool, Request, optimized_target
from .routing import POLICIES as ROUTER_POLICIES
from .tier_replay import check_policy

if TYPE_CHECKING:
    from radixspec.spec.tiers import WritePolicy

    from .targets.api import PrefixCacheTarget, TieredCacheTarget

# a target's handle: the driver hands it back to the target that made it
H = TypeVar("H")
# a namespace as a trace line writes it (namespace_of reads it back)
JsonNamespace = list[str | int] | None
IMPLS = ("spec", "reference", "optimized")


# ---------------------------------------------------------------- traces


def namespace_of(value: object) -> Namespace:
    """A trace's namespace as the spec's domain: null, a JSON list (a tuple, nested), or a string s -> (s,)."""

    def as_tuple(item: object) -> object:
        return tuple(as_tuple(x) for x in item) if isinstance(item, list) else item

    if value is None:
        return None
    return check_namespace(as_tuple(value) if isinstance(value, list) else (value,))


# the most tokens one request of a trace may expand to: a line cannot cost more memory than this
MAX_REQUEST_TOKENS = 1 << 22


def load_line(line: str, number: int, path: Path) -> dict[str, object]:
    """One line of a trace as a JSON object; ValueError naming the line otherwise."""
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{number}: a request is a JSON object, got {type(record).__name__}")
    return record


# the trace formats, each with the tokens of one of its blocks unless --block-size says otherwise (JSONL: none)
BLOCK_SIZES = {"jsonl": 1, "mooncake": 512, "bailian": 16}


def detect_format(path: Path) -> str:
    """``jsonl``, ``mooncake`` or ``bailian``, from the first request's fields."""
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                record = load_line(line, number, path)
                if "hash_ids" not in record:
                    return "jsonl"
                return "bailian" if "chat_id" in record else "mooncake"
    raise ValueError(f"{path}: no request in the trace")


def read_trace(path: Path, fmt: str = "auto", block_size: int | None = None) -> Iterator[Request]:
    """The requests of a trace, in replay order (by timestamp when the lines carry one; file order else), blocks
    of ``block_size`` tokens (the format's own by default); ValueError naming the line for a malformed one."""
    fmt = detect_format(path) if fmt == "auto" else fmt
    block_size = BLOCK_SIZES[fmt] if block_size is None else block_size
    stamped: list[tuple[float, int, int]] = []
    with path.open() as lines:
        for number, line in enumerate(lines):
            if line.strip():
                stamp = load_line(line, number + 1, path).get("timestamp") if '"timestamp"' in line else None
                # a number: an int or a float, not a bool (JSON's true), not NaN
                if stamp is not None and (
                    isinstance(stamp, bool) or not isinstance(stamp, int | float) or stamp != stamp
                ):
                    raise ValueError(f"{path}:{number + 1}: 'timestamp' must be a number, got {stamp!r}")
                stamped.append((0.0 if stamp is None else float(stamp), number, 0))
    order = {number for _, number, _ in stamped}
    ranks = {number: rank for rank, (_, number, _) in enumerate(sorted(stamped))}
    # two passes: the order from the stamps, then the requests (one line at a time: traces are big)
    by_rank: dict[int, Request] = {}
    next_rank = 0
    with path.open() as lines:
        for number, line in enumerate(lines):
            if number not in order:
                continue
            record = load_line(line, number + 1, path)
            by_rank[ranks[number]] = parse_request(record, fmt, block_size, number + 1, path)
            while next_rank in by_rank:
                yield by_rank.pop(next_rank)
                next_rank += 1


def parse_request(record: dict[str, object], fmt: str, block_size: int, line: int, path: Path) -> Request:
    """One line of the trace as (tokens, namespace); ValueError naming the line when it is malformed.

    A Mooncake line's tokens are made one by one up to its ``input_length`` (never a whole block past it), and
    no line expands to more than MAX_REQUEST_TOKENS tokens."""
    where = f"{path}:{line}"
    if fmt in ("mooncake", "bailian"):
        hash_ids, length = record.get("hash_ids"), record.get("input_length")
        if not isinstance(hash_ids, list) or not all(type(h) is int and h >= 0 for h in hash_ids):
            raise ValueError(f"{where}: a {fmt.capitalize()} request needs hash_ids, a list of ints >= 0")
        if type(length) is not int or not 0 <= length <= MAX_REQUEST_TOKENS:
            raise ValueError(f"{where}: input_length must be an int in [0, {MAX_REQUEST_TOKENS}], got {length!r}")
        length = min(length, len(hash_ids) * block_size)
        tokens = [(hash_ids[i // block_size] * block_size + i % block_size) % TOKEN_LIMIT for i in range(length)]
        return tokens, namespace_of_line(record.get("namespace"), where)
    ids = record.get("tokens")
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < TOKEN_LIMIT for t in ids):
        raise ValueError(f"{where}: 'tokens' must be a list of token ids in [0, 2**63)")
    if len(ids) > MAX_REQUEST_TOKENS:
        raise ValueError(f"{where}: {len(ids)} tokens, more than a request may have ({MAX_REQUEST_TOKENS})")
    return ids, namespace_of_line(record.get("namespace"), where)


def namespace_of_line(value: object, where: str) -> Namespace:
    """``namespace_of`` with the line named in its error."""
    try:
        return namespace_of(value)
    except CacheError as exc:
        raise ValueError(f"{where}: namespace {exc}") from None


def generate(out: Path, requests: int, seed: int = 0) -> None:
    """A synthetic JSONL trace: shared system prompts, multi-turn chats, few-shot blocks, a few tenants."""
    rng = random.Random(seed)
    vocabulary = 32_000

    def text(n: int) -> list[int]:
        return [rng.randrange(vocabulary) for _ in range(n)]

    system_prompts = [text(rng.randint(64, 512)) for _ in range(8)]
    examples = [text(rng.randint(32, 128)) for _ in range(24)]
    tenants: list[JsonNamespace] = [None, ["tenant", "a"], ["tenant", "b"], ["lora", 1]]
    chats: list[tuple[list[int], JsonNamespace]] = []
    with out.open("w") as sink:
        for number in range(requests):
            kind = rng.random()
            if kind < 0.45 and chats and rng.random() < 0.7:
                # the next turn of a running chat: the whole history, an answer, a new question
                index = rng.randrange(len(chats))
                history, tenant = chats[index]
                prompt = history + text(rng.randint(16, 96)) + text(rng.randint(8, 64))
                chats[index] = (prompt, tenant)
                if len(prompt) > 4096:
                    chats.pop(index)
            elif kind < 0.8:
                tenant = rng.choice(tenants)
                prompt = rng.choice(system_prompts) + text(rng.randint(8, 128))
                chats.append((prompt, tenant))
                if len(chats) > 256:
                    chats.pop(0)
            else:
                tenant = rng.choice(tenants)
                shots = rng.sample(range(4), rng.randint(2, 4))
                block = rng.randrange(6) * 4
                prompt = [t for shot in shots for t in examples[block + shot]] + text(rng.randint(8, 64))
            line: dict[str, object] = {"tokens": prompt, "timestamp": number}
            if tenant is not None:
                line["namespace"] = tenant
            sink.write(json.dumps(line, separators=(",", ":")) + "\n")


# ---------------------------------------------------------------- the replay


@dataclass
class Row:
    """What one implementation did with one pool size."""

    impl: str
    pool_pages: int
    page_size: int
    requests: int
    # requests longer than the whole pool (not replayed)
    too_long: int
    asked_tokens: int
    hit_tokens: int
    hit_rate: float
    request_hit_rate: float
    # None where the cache does not tell (a request-lifecycle target: fuzz/lifecycle_replay.py)
    evicted_pages: int | None
    pages_in_use: int | None
    peak_pages_in_use: int | None
    seconds: float
    # a request-lifecycle target's configuration, as drawn from the pool size; ours beside it: the groups it ran
    config: str = ""


def replay_ours(
    impl: str, page_size: int, pool_pages: int, requests: Iterator[Request], progress: TextIO | None = None
) -> Row:
    """``replay_trace`` of our implementation ``impl`` through its target (``fuzz/targets/ours.py``), made with
    no KV events: a replay reads none, and a long trace's would fill memory. The pool size is the replay's: our
    caches have no capacity."""
    from .targets.ours import ReferenceCache, SpecCache

    def run(target: PrefixCacheTarget[H]) -> Row:
        return replay_trace(Pool(Driver(impl, target, page_size), pool_pages, page_size), requests, progress)

    if impl == "spec":
        return run(SpecCache(page_size))
    if impl == "reference":
        reference = ReferenceCache(page_size)
        reference.cache.events = None
        return run(reference)
    optimized = optimized_target(page_size)
    optimized.cache.events = None
    return run(optimized)


def replay_target(
    name: str, page_size: int, pool_pages: int, requests: Iterator[Request], progress: TextIO | None = None
) -> Row:
    """``replay_trace`` of a target of the target API (``--target NAME``), its pool ``pool_pages`` pages."""
    from .targets import resolve

    info = resolve(name)
    assert info.cache_factory is not None, f"target {name} has no prefix cache"
    driver = Driver(name, info.cache_factory(page_size, pool_pages), page_size)
    return replay_trace(Pool(driver, pool_pages, page_size), requests, progress)


def replay_lifecycle(
    name: str,
    page_size: int,
    pool_pages: int,
    trace: Callable[[], Iterator[Request]],
    windows: tuple[int | None, ...] = (None,),
    progress: TextIO | None = None,
) -> list[Row]:
    """A request-lifecycle target (``--target NAME`` with a hybrid layer: fuzz/lifecycle_replay.py), its groups
    ``windows`` (as it takes them), and ours beside it, with the engine's pool and groups: two rows. LawBroken when
    the target breaks a law."""
    from .lifecycle_replay import engine_placer, ours_beside
    from .targets import resolve

    engine = engine_placer(resolve(name), page_size, pool_pages, windows)
    return [replay_trace(placer, trace(), progress) for placer in (engine, ours_beside(engine))]


class Placer(Protocol):
    """A cache and its pool, serving one prompt at a time as a cache manager does (``pools.Pool``, or a
    request-lifecycle target's: ``lifecycle_replay.LifecyclePlacer``)."""

    @property
    def name(self) -> str: ...

    @property
    def pool_pages(self) -> int: ...

    @property
    def page_size(self) -> int: ...

    def place(self, tokens: list[int], namespace: Namespace) -> int | None:
        """The tokens the prompt hit, or None when it was not placed (empty, or more than the pool holds)."""

    # what the cache is configured as, for the row ('' when nothing is drawn)
    config: str

    def cached_page_count(self) -> int | None: ...

    def evicted_pages(self) -> int | None: ...

    def finish(self) -> None:
        """The end of a replay: the cache's own checks where it has them."""


# seconds between two progress lines of a long replay (on stderr)
PROGRESS_S = 10.0


def replay_trace(placer: Placer, requests: Iterator[Request], progress: TextIO | None = None) -> Row:
    """Every request through ``placer``, as a cache manager does for prompts; the figures. With ``progress``, a line
    every PROGRESS_S seconds says how far a long replay got."""
    pool_pages, p = placer.pool_pages, placer.page_size
    count = too_long = asked = hits = hit_requests = 0
    peak: int | None = None
    start = last = time.perf_counter()
    for tokens, namespace in requests:
        count += 1
        if progress is not None and count % 256 == 0 and time.perf_counter() - last >= PROGRESS_S:
            last = time.perf_counter()
            print(
                f"  ... {placer.name} at {pool_pages} pages: {count} requests in {last - start:.0f} s",
                file=progress,
                flush=True,
            )
        cached = placer.place(tokens, namespace)
        if cached is None:
            too_long += bool(tokens)
            continue
        asked += len(tokens)
        hits += cached
        hit_requests += cached > 0
        pages = placer.cached_page_count()
        peak = None if pages is None else max(peak or 0, pages)
    placer.finish()
    return Row(
        impl=placer.name,
        pool_pages=pool_pages,
        page_size=p,
        requests=count,
        too_long=too_long,
        asked_tokens=asked,
        hit_tokens=hits,
        hit_rate=hits / asked if asked else 0.0,
        request_hit_rate=hit_requests / max(count - too_long, 1),
        evicted_pages=placer.evicted_pages(),
        pages_in_use=placer.cached_page_count(),
        peak_pages_in_use=peak,
        seconds=round(time.perf_counter() - start, 3),
        config=placer.config,
    )


def plot(rows: Sequence[Row], path: Path) -> None:
    """Hit rate against pool size, one line per implementation."""
    from .plots import plot_hit_rates

    curves = {
        impl: [(row.pool_pages, row.hit_rate) for row in rows if row.impl == impl]
        for impl in dict.fromkeys(row.impl for row in rows)
    }
    plot_hit_rates(curves, f"pool size (pages of {rows[0].page_size} tokens)", path)


# ---------------------------------------------------------------- command line


def pool_sizes(text: str) -> list[int]:
    """An argparse type: comma-separated page counts, each > 0."""
    return counts_from(text, minimum=1)


def page_counts(text: str) -> list[int]:
    """An argparse type: comma-separated page counts, each >= 0."""
    return counts_from(text, minimum=0)


def counts_from(text: str, minimum: int) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated page counts, got {text!r}") from None
    if not sizes or min(sizes) < minimum:
        raise argparse.ArgumentTypeError(f"page counts must be >= {minimum}, got {text!r}")
    return sizes


def positive(text: str) -> int:
    """An argparse type: an int > 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixspec replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", nargs="?", type=Path, help="the trace (JSONL, Mooncake or Bailian)")
    parser.add_argument("--impl", choices=(*IMPLS, "all"), default=None, help="our implementation(s) (default: all)")
    parser.add_argument(
        "--target", default=None, help="a target of the target API instead (radixspec fuzz --list-targets)"
    )
    parser.add_argument("--pool-pages", type=pool_sizes, default=[256, 1024, 4096])
    parser.add_argument("--page-size", type=positive, default=16)
    parser.add_argument("--format", choices=("auto", *BLOCK_SIZES), default="auto")
    parser.add_argument(
        "--block-size", type=positive, default=None, help="tokens per hash id (Mooncake: 512, Bailian: 16)"
    )
    parser.add_argument(
        "--window",
        type=positive,
        default=None,
        help="with --target of a request lifecycle: a sliding-window group of WINDOW tokens beside full attention"
        " (a target that needs one takes its own else)",
    )
    parser.add_argument(
        "--lifecycle",
        action="store_true",
        help="with --target: serve the requests through its request lifecycle even where it has a prefix cache"
        " too (vllm: a dense model's KVCacheManager path; fuzz/lifecycle_replay.py)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the rows as a JSON list")
    parser.add_argument("--plot", type=Path, default=None, help="plot hit rate against pool size (PNG)")
    parser.add_argument(
        "--plot-with",
        type=Path,
        action="append",
        default=[],
        metavar="ROWS_JSON",
        help="also plot the rows of an earlier --json (another target, another trace); repeatable",
    )
    parser.add_argument(
        "--workers",
        type=pool_sizes,
        default=None,
        metavar="N[,N...]",
        help="replay over N workers behind a router instead (each our optimized cache of --pool-pages pages;"
        " radixspec.fuzz.routing): one row per router policy, N and pool size",
    )
    parser.add_argument(
        "--router",
        default=",".join(ROUTER_POLICIES),
        help="with --workers: router policies, comma-separated (dynamo, radixspec, round-robin, least-loaded)",
    )
    parser.add_argument(
        "--tiers",
        action="store_true",
        help="replay through tiered caches instead: hit rate by tier (device, host, storage) against --host-pages"
        " and --storage-pages, --pool-pages being the device's (radixspec.fuzz.tier_replay)",
    )
    parser.add_argument("--host-pages", type=pool_sizes, default=[256, 1024, 4096], help="with --tiers")
    parser.add_argument("--storage-pages", type=page_counts, default=[0, 16384], help="with --tiers (0: none)")
    parser.add_argument("--policy", type=check_policy, default="write_through", help="with --tiers: write policy")
    parser.add_argument("--generate", type=Path, default=None, help="write a synthetic JSONL trace here and stop")
    parser.add_argument("--requests", type=positive, default=10_000, help="requests of the generated trace")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.generate is not None:
        if not args.generate.parent.is_dir():
            parser.error(f"--generate {args.generate}: no directory {args.generate.parent}")
        generate(args.generate, args.requests, args.seed)
        print(f"wrote {args.requests} requests to {args.generate}")
        return 0
    if args.trace is None:
        parser.error("name a trace (or --generate PATH)")
    if args.tiers and (args.workers is not None or args.plot_with):
        parser.error(
            "--tiers replays our spec, reference and optimized tiered caches (or a --target's): no --workers"
            " or --plot-with"
        )
    if not args.trace.is_file():
        parser.error(f"no trace file {args.trace}")
    if args.target and args.impl:
        parser.error("--impl and --target exclude each other")
    policies = [part.strip() for part in args.router.split(",") if part.strip()]
    if args.workers is not None:
        from .routing import check_policies

        if args.target or args.impl:
            parser.error("--workers replays over our optimized workers: no --impl or --target")
        if args.plot_with:
            parser.error("--plot-with plots pool-size rows, not --workers rows")
        problem = check_policies(policies)
        if problem:
            parser.error(problem)
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib (pip install radixspec[plot])")
    earlier: list[Row] = []
    for path in args.plot_with:
        try:
            earlier += [Row(**row) for row in json.loads(path.read_text())]
        except (OSError, ValueError, TypeError) as exc:
            parser.error(f"--plot-with {path}: not rows written by --json ({exc})")
    try:
        fmt = detect_format(args.trace) if args.format == "auto" else args.format
        next(read_trace(args.trace, fmt, args.block_size))  # a malformed first request fails here, before any run
    except (ValueError, CacheError) as exc:
        parser.error(str(exc))
    page_size: int = args.page_size
    if args.workers is not None:
        return replay_routing(args, fmt, policies)
    if args.tiers:
        return replay_tiered(args, parser, fmt)
    # each implementation's replay: (pool pages, the trace read anew) -> its rows
    runs: list[Callable[[int, Callable[[], Iterator[Request]]], list[Row]]]
    from .lifecycle_replay import LawBroken
    from .targets.api import TargetError

    if args.target:
        windows: tuple[int | None, ...] = (None,) if args.window is None else (None, args.window)
        runs = [target_run(args.target, page_size, parser, args.lifecycle, windows)]
    else:
        impls = IMPLS if args.impl in (None, "all") else (args.impl,)
        runs = [functools.partial(ours_run, impl, page_size) for impl in impls]
    rows: list[Row] = []
    print(
        f"{'impl':<{IMPL_WIDTH}} {'pool pages':>10} {'requests':>9} {'hit rate':>9} {'req hits':>9} {'evicted':>9}"
        f" {'in use':>7} {'peak':>7} {'seconds':>8}"
    )
    for pages in args.pool_pages:
        for run in runs:
            try:
                got = run(pages, functools.partial(read_trace, args.trace, fmt, args.block_size))
            except LawBroken as exc:
                print(f"LAW BROKEN: {exc}", file=sys.stderr)
                return 1
            except (ValueError, CacheError, TargetError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            for row in got:
                rows.append(row)
                print(format_row(row), flush=True)
    return finish(args, [asdict(row) for row in rows], differential(rows), lambda path: plot([*rows, *earlier], path))


def ours_run(impl: str, page_size: int, pages: int, trace: Callable[[], Iterator[Request]]) -> list[Row]:
    """Our implementation ``impl``'s row for a pool of ``pages`` pages."""
    return [replay_ours(impl, page_size, pages, trace(), progress=sys.stderr)]


def target_run(
    name: str,
    page_size: int,
    parser: argparse.ArgumentParser,
    lifecycle: bool = False,
    windows: tuple[int | None, ...] = (None,),
) -> Callable[[int, Callable[[], Iterator[Request]]], list[Row]]:
    """``--target NAME``'s replay by the layer it has: its prefix cache (one row per pool size; unless
    ``lifecycle``), else its request lifecycle (two rows: the engine's, ours beside it); a usage error naming what
    to run instead when it has neither."""
    from .targets import resolve
    from .targets.api import TargetError

    try:
        info = resolve(name)
    except TargetError as exc:
        parser.error(str(exc))
    if info.profile is not None and not info.profile.namespaces:
        print(f"note: target {name} has no namespaces: every request is replayed in one namespace")
    if lifecycle and info.hybrid_factory is None:
        parser.error(f"--lifecycle: target {name} has no request lifecycle (no hybrid layer)")
    if len(windows) > 1 and (info.hybrid_factory is None or (info.cache_factory is not None and not lifecycle)):
        parser.error(f"--window: target {name} is replayed as a prefix cache, which has no window")
    if info.cache_factory is not None and not lifecycle:
        return lambda pages, trace: [replay_target(name, page_size, pages, trace(), progress=sys.stderr)]
    if info.hybrid_factory is not None:
        if info.page_sizes is not None and page_size not in info.page_sizes:
            parser.error(f"target {name} takes pages of {', '.join(map(str, info.page_sizes))} tokens")
        print(f"note: {name} serves each request whole (chunked prefill, no output tokens), ours beside it")
        return lambda pages, trace: replay_lifecycle(name, page_size, pages, trace, windows, progress=sys.stderr)
    if info.router_factory is not None:
        parser.error(
            f"target {name} is a router's index: replay the trace over workers behind it, without --target"
            " (--workers N --router dynamo,radixspec)"
        )
    if info.tiered_factory is not None:
        parser.error(f"target {name} is a tiered cache: replay it with --tiers")
    parser.error(
        f"target {name} plans its own batches and transfers (or offloads for a scheduler): a trace has no layer of it"
        f" to drive; radixspec fuzz --target {name} runs it"
    )


# the table's first column (ours beside a target is ours@TARGET)
IMPL_WIDTH = 18


def format_row(row: Row) -> str:
    """One row of the table (``-`` where the cache does not tell), its configuration below it."""

    def cell(value: int | None, width: int) -> str:
        return f"{'-' if value is None else value:>{width}}"

    line = (
        f"{row.impl:<{IMPL_WIDTH}} {row.pool_pages:>10} {row.requests:>9} {100 * row.hit_rate:>8.2f}%"
        f" {100 * row.request_hit_rate:>8.2f}% {cell(row.evicted_pages, 9)} {cell(row.pages_in_use, 7)}"
        f" {cell(row.peak_pages_in_use, 7)} {row.seconds:>8.2f}"
    )
    return f"{line}\n  {row.config}" if row.config else line


def finish(args: argparse.Namespace, rows: Sequence[object], mismatch: str, draw: Callable[[Path], None]) -> int:
    """The end of a replay: the differential's verdict, the rows (as dicts) in JSON (``--json``), the plot (``--plot``);
    the exit status (1 when our implementations disagree)."""
    if mismatch:
        print(f"DIFFERENTIAL FAILED: {mismatch}", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
        print(f"rows written to {args.json}")
    if args.plot is not None:
        draw(args.plot)
        print(f"plot written to {args.plot}")
    return 1 if mismatch else 0


def replay_routing(args: argparse.Namespace, fmt: str, policies: Sequence[str]) -> int:
    """``--workers``: the trace over N workers behind each router policy (``radixspec.fuzz.routing``)."""
    from .routing import as_json, header, line, plot, route

    rows = []
    for pages in args.pool_pages:
        print(f"pool of {pages} pages of {args.page_size} tokens per worker")
        print(header())
        for workers in args.workers:
            for policy in policies:
                row = route(read_trace(args.trace, fmt, args.block_size), policy, workers, pages, args.page_size)
                rows.append(row)
                print(line(row), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(as_json(rows), indent=2) + "\n")
        print(f"rows written to {args.json}")
    if args.plot is not None:
        plot([row for row in rows if row.pool_pages == args.pool_pages[0]], args.plot)
        print(f"plot written to {args.plot}")
    return 0


def replay_tiered(args: argparse.Namespace, parser: argparse.ArgumentParser, fmt: str) -> int:
    """``--tiers``: a row per cache and (device, host, storage) size, the differential, the JSON and the plot."""
    from . import tier_replay as tr
    from .targets.api import TargetError

    makers: dict[str, Callable[[int, int, int, int, WritePolicy, int], TieredCacheTarget]] = {}
    if args.target:
        from .targets import resolve

        try:
            factory = resolve(args.target).tiered_factory
        except TargetError as exc:
            parser.error(str(exc))
        if factory is None:
            parser.error(f"target {args.target} has no tiered layer")
        makers[args.target] = factory
    else:
        for impl in tr.TIER_IMPLS if args.impl in (None, "all") else (args.impl,):
            makers[impl] = tr.our_tiered_cache(impl)
    rows: list[tr.TierRow] = []
    print(f"write policy {args.policy}, pages of {args.page_size} tokens")
    print(tr.HEADER)
    for sizes in itertools.product(args.pool_pages, args.host_pages, args.storage_pages):
        for name, make in makers.items():
            requests = read_trace(args.trace, fmt, args.block_size)
            try:
                row = tr.replay_tiers(name, make, args.page_size, sizes, args.policy, requests, sys.stderr)
            except (ValueError, CacheError, TargetError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            rows.append(row)
            print(tr.format_row(row), flush=True)
    return finish(args, [asdict(row) for row in rows], tr.differential(rows), lambda path: tr.plot(rows, path))


def differential(rows: Sequence[Row]) -> str:
    """Where our implementations disagree on a pool size (they must not): a sentence, or ''."""
    ours = [row for row in rows if row.impl in IMPLS]
    for pages in dict.fromkeys(row.pool_pages for row in ours):
        same = [row for row in ours if row.pool_pages == pages]
        figures = {
            row.impl: (row.hit_tokens, row.asked_tokens, row.evicted_pages, row.pages_in_use, row.peak_pages_in_use)
            for row in same
        }
        if len(set(figures.values())) > 1:
            return f"pool of {pages} pages: {figures}"
    return ""


if __name__ == "__main__":
    sys.exit(main())
