"""How one rank's engine is put together: which KV pool and scheduler its semantics take,
and every part built with its collaborators (the engine's constructor delegates here).

The default semantics is vLLM 0.33's (engined/core/paged/); `semantics = mocker-1.3.0` or
`prefix_hit_rule = mocker-1.3.0`, and configurations vLLM has no counterpart for (offload
tiers), get the mocker's lineage pool (kv_manager.py) and scheduler (scheduling.py).
"""

from __future__ import annotations

import random
import sys
from collections import deque
from typing import NamedTuple

from engined.core.args import EngineArgs, EngineType, PreemptionMode, SchedulingPolicy
from engined.core.capacity import CapacityGeneration
from engined.core.commands import Commands
from engined.core.emission import TokenEmitter
from engined.core.errors import InvalidArgsError
from engined.core.finish import Finisher
from engined.core.handoff_book import HandoffBook
from engined.core.intake import RequestIntake
from engined.core.kv_manager import KvManager
from engined.core.offload.config import OffloadConfig
from engined.core.offload.parking import OnboardParking
from engined.core.offload.tier_engine import TierEngine
from engined.core.paged.admission import PagedAdmission
from engined.core.paged.async_batches import AsyncBatches, Batch
from engined.core.paged.kv_cache_manager import PagedKvManager
from engined.core.paged.pass_limits import PassLimits
from engined.core.paged.residency import BlockResidency
from engined.core.paged.scheduler import PagedScheduler
from engined.core.pausing import PauseControl
from engined.core.perf_model import make_perf_model
from engined.core.policy import AdmissionPolicy, TrtllmNoEvictPolicy, context_length
from engined.core.preemption import Preempter
from engined.core.prefix_hit import PrefixHit
from engined.core.queued import QueuedLengths, TalliedState, waiting_class
from engined.core.scheduling import Scheduler
from engined.core.speculative import SpeculativeSampler
from engined.core.vllm_hashing import BlockHasher, none_hash
from engined.core.vocab import Vocabulary

_UNBOUNDED = sys.maxsize
_MASK64 = (1 << 64) - 1


class EngineParts(NamedTuple):
    """The parts of one engine, for white-box tests that set up states no command reaches.

    Not part of the contract: code outside tests goes through the `Engine` methods.
    """

    state: TalliedState
    kv: KvManager | PagedKvManager
    book: HandoffBook
    parking: OnboardParking
    intake: RequestIntake
    queued: QueuedLengths
    capacity: CapacityGeneration
    scheduler: Scheduler | PagedScheduler
    emitter: TokenEmitter
    commands: Commands
    finisher: Finisher
    preempter: Preempter
    # With `async_scheduling`: the batch queue the passes run through.
    batches: AsyncBatches | None = None
    # vLLM's pause and sleep: vLLM semantics without async scheduling only.
    pausing: PauseControl | None = None


def check_vllm_only(args: EngineArgs, *, paged: bool) -> None:
    """Refuse the options only vLLM's scheduler has when the core will not run it (`paged`
    False: the mocker's pool); the daemon's config validation asks the same before starting.

    Raises:
        InvalidArgsError: naming the option.
    """
    if paged:
        nextn, budget = args.aic_nextn, args.max_num_batched_tokens
        if nextn is not None and budget is not None and budget <= nextn:
            # vLLM's `VllmConfig._set_max_num_scheduled_tokens`: a step must hold a token
            # and its lookahead slots.
            raise InvalidArgsError(
                "VllmConfig does not have enough slots to schedule a token and support the "
                f"speculative decoding settings. Got max_num_batched_tokens={budget} and "
                f"num_lookahead_tokens={nextn}.",
                key="max_num_batched_tokens",
            )
        cap = args.max_num_scheduled_tokens
        if nextn is not None and cap is not None and cap <= nextn:
            # engined's own: vLLM accepts it, then holds a one-token admission (padded to
            # 1 + drafts) at the head of its queue forever.
            raise InvalidArgsError(
                f"max_num_scheduled_tokens ({cap}) must be greater than aic_nextn ({nextn}): "
                "an admission padded with its draft tokens could never be scheduled",
                key="max_num_scheduled_tokens",
            )
        return
    for key, value, on in (
        ("scheduling_policy", "=priority", args.scheduling_policy is SchedulingPolicy.PRIORITY),
        ("async_scheduling", "", args.async_scheduling),
        ("lookahead_block_hashes", "=false", not args.lookahead_block_hashes),
        ("drafting_slots", f"={args.drafting_slots}", args.drafting_slots > 0),
        ("eagle_block_drop", "", args.eagle_block_drop),
        ("kv_cache_metrics", "", args.kv_cache_metrics),
        ("enable_lora", "", args.enable_lora),
        ("watermark", f"={args.watermark}", args.watermark > 0),
        ("max_num_active_seqs", "", args.max_num_active_seqs is not None),
        ("max_num_scheduled_tokens", "", args.max_num_scheduled_tokens is not None),
        (
            "prefill_schedule_interval",
            f"={args.prefill_schedule_interval}",
            args.prefill_schedule_interval > 1,
        ),
        (
            "long_prefill_token_threshold",
            f"={args.long_prefill_token_threshold}",
            args.long_prefill_token_threshold > 0,
        ),
    ):
        if on:
            raise InvalidArgsError(
                f"{key}{value} needs vLLM semantics (semantics = vllm, "
                "engine_type = vllm, no offload tiers)",
                key=key,
            )


def served_context(args: EngineArgs) -> int:
    """The longest prompt + output a rank built from normalized `args` serves, which the
    daemon advertises (`welcome.max_model_len`, so a front end refuses what the rank would).

    `args.enforced_max_model_len`, capped by the blocks a request can hold: vLLM's pool keeps
    one aside (its null block), the mocker's none.
    """
    blocks = args.num_gpu_blocks
    usable = PagedKvManager.usable_of(blocks) if runs_vllm_pool(args) else blocks
    return context_length(usable, args.block_size, args.enforced_max_model_len)


def runs_vllm_pool(args: EngineArgs) -> bool:
    """Whether a rank built from `args` runs vLLM's pool and scheduler (engined/core/paged/):
    vLLM semantics without offload tiers, which only the mocker's pool has.

    Raises:
        InvalidArgsError: an impossible offload shape (`OffloadConfig.from_args`).
    """
    return args.runs_vllm_semantics() and OffloadConfig.from_args(args) is None


def assemble(
    args: EngineArgs,
    *,
    dp_rank: int,
    worker_id: int,
    tiers: TierEngine | None,
    fast_paths: bool,
    python_hash_seed: str | None,
) -> EngineParts:
    """The parts of a rank's engine from normalized `args` (see `Engine.__init__`)."""
    algo = args.prefix_caching_hash_algo
    bs = args.block_size
    num_blocks = args.num_gpu_blocks
    # The requests admitted into running: vLLM's max_num_active_seqs when set (its
    # max_num_seqs also sizes the model runner, which engined has none of).
    max_num_seqs = args.max_num_active_seqs or args.max_num_seqs or _UNBOUNDED
    max_batched_tokens = args.pass_token_budget or _UNBOUNDED
    if tiers is None:
        offload_config = OffloadConfig.from_args(args)
        tiers = TierEngine(offload_config) if offload_config is not None else None
    paged = tiers is None and runs_vllm_pool(args)
    check_vllm_only(args, paged=paged)
    by_priority = args.scheduling_policy is SchedulingPolicy.PRIORITY
    kv: KvManager | PagedKvManager
    if paged:
        kv = PagedKvManager(
            num_blocks,
            bs,
            dp_rank=dp_rank,
            caching=args.enable_prefix_caching,
            max_model_len=args.enforced_max_model_len,
            hasher=BlockHasher(algo, none_hash(algo, python_hash_seed)),
            # vLLM's collector only sees evictions with caching on (`get_new_blocks`).
            residency=BlockResidency(args.kv_cache_metrics_sample, args.seed * 1_000_003 + dp_rank)
            if args.kv_cache_metrics and args.enable_prefix_caching
            else None,
            lookahead=args.aic_nextn is not None and args.lookahead_block_hashes,
            drop_last_hit=args.aic_nextn is not None and args.eagle_block_drop,
        )
    else:
        kv = KvManager(
            num_blocks,
            bs,
            dp_rank=dp_rank,
            publish=args.enable_prefix_caching,
            prefix_hit=PrefixHit.from_args(args),
            tiers=tiers,
        )
    policy_cls = TrtllmNoEvictPolicy if args.engine_type is EngineType.TRTLLM else AdmissionPolicy
    policy = policy_cls(
        kv.usable_blocks,
        bs,
        None if args.enable_chunked_prefill else max_batched_tokens,
        args.enforced_max_model_len,
    )
    capacity = CapacityGeneration()
    # FPM's queued-request tallies, kept by the queues themselves (engined/core/queued.py).
    queued = QueuedLengths()
    book = HandoffBook(queued.decode)
    state = TalliedState(
        waiting_class(queued, book.active.by_request.__contains__), priority=by_priority
    )
    rng = random.Random(args.seed * 1_000_003 + dp_rank)
    vocab = Vocabulary(args.vocab_size, args.excluded_token_ids)
    intake = RequestIntake(
        policy,
        block_size=bs,
        caching=args.enable_prefix_caching,
        rng=rng,
        vocab=vocab,
        seed=args.seed,
        paged=paged,
        lora=args.enable_lora,
        # Per request, not per rank: a request accepts the same drafts on any rank.
        mtp_seed=args.aic_mtp_seed if paged and args.aic_nextn is not None else None,
    )
    sampler = (
        SpeculativeSampler(args.nextn_accept_rates, (args.aic_mtp_seed + worker_id) & _MASK64)
        if args.aic_nextn is not None
        else None
    )
    perf = make_perf_model(
        args.perf_model,
        prefill_ms_per_token=args.fixed_prefill_ms_per_token,
        pass_overhead_ms=args.fixed_pass_overhead_ms,
        decode_ms_per_pass=args.fixed_decode_ms_per_pass,
    )
    parking = OnboardParking(state, kv, capacity)
    finisher = Finisher(state, kv, book, parking, capacity, args)
    preempter = Preempter(
        state,
        kv,
        policy,
        capacity,
        lifo=args.preemption_mode is PreemptionMode.LIFO,
        by_priority=by_priority,
    )
    scheduler: Scheduler | PagedScheduler
    if isinstance(kv, PagedKvManager):
        # vLLM's adaptive long-prefill floor shares its input budget, max_num_batched_tokens.
        limits = PassLimits(args, args.max_num_batched_tokens or _UNBOUNDED)
        admission = PagedAdmission(
            args,
            max_num_seqs=max_num_seqs,
            limits=limits,
            state=state,
            kv=kv,
            policy=policy,
            pending=book.pending,
            finisher=finisher,
        )
        scheduler = PagedScheduler(
            args,
            max_batched_tokens=max_batched_tokens,
            state=state,
            kv=kv,
            policy=policy,
            admission=admission,
            limits=limits,
            preempter=preempter,
            perf=perf,
            vocab=vocab,
            fast_paths=fast_paths,
        )
    else:
        scheduler = Scheduler(
            args,
            max_num_seqs=max_num_seqs,
            max_batched_tokens=max_batched_tokens,
            state=state,
            kv=kv,
            policy=policy,
            parking=parking,
            pending=book.pending,
            finisher=finisher,
            preempter=preempter,
            perf=perf,
            fast_paths=fast_paths,
        )
    emitter = TokenEmitter(
        args,
        state=state,
        kv=kv,
        mocker_kv=kv if isinstance(kv, KvManager) else None,
        preempter=preempter,
        finisher=finisher,
        sampler=sampler,
        vocab=vocab,
        perf=perf,
        fast_paths=fast_paths,
    )
    in_flight: deque[Batch] = deque()
    pausing = PauseControl(state, kv, book, preempter, in_flight) if paged else None
    commands = Commands(
        block_size=bs,
        num_blocks=kv.usable_blocks,
        max_num_seqs=max_num_seqs,
        intake=intake,
        state=state,
        kv=kv,
        book=book,
        finisher=finisher,
        capacity=capacity,
        policy=policy,
        vocab=vocab,
        pausing=pausing,
    )
    batches = None
    if args.async_scheduling:
        assert isinstance(scheduler, PagedScheduler) and isinstance(kv, PagedKvManager)
        batches = AsyncBatches(
            state=state,
            scheduler=scheduler,
            kv=kv,
            emitter=emitter,
            queue=in_flight,
            pausing=pausing,
        )
    return EngineParts(
        state,
        kv,
        book,
        parking,
        intake,
        queued,
        capacity,
        scheduler,
        emitter,
        commands,
        finisher,
        preempter,
        batches,
        pausing,
    )
