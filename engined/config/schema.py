"""The schema: `DaemonConfig`, whose fields give every daemon key, type and default.

Kept apart from loading so that the daemon and the tools can import the type without the
flag table or the layering machinery.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from engined.core.args import EngineArgs

LogFormat = Literal["auto", "console", "json"]
LogLevel = Literal["debug", "info", "warning", "error"]
KvEventsFormat = Literal["vllm", "vllm-array"]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]

_DEFAULT_ENGINE = EngineArgs().normalized()
# The defaults of the control socket's byte budgets, which the server's parts also take when
# built without a configuration.
CONTROL_INFLIGHT_BYTES = 256 * 1024 * 1024
CONTROL_UNREAD_BYTES = 64 * 1024 * 1024


def _help(text: str) -> msgspec.Meta:
    """A field's `engined serve --help` line, declared beside the field (`FLAGS` reads it)."""
    return msgspec.Meta(description=text)


class DaemonConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every daemon setting: the `_help` texts and the comments are the configuration reference.

    Build it with `load_config`, which validates across fields (endpoints against `dp_size`).
    `engine` holds normalised `EngineArgs`; the default is already normalised so that
    `DaemonConfig()` equals the configuration loaded from nothing.
    """

    # Reported in `welcome`.
    model_name: Annotated[str, msgspec.Meta(min_length=1), _help("Served model name.")] = "engined"
    # The ROUTER the clients' DEALERs connect to (protocol.md §1).
    control_endpoint: Annotated[str, _help("Control ROUTER.")] = "tcp://127.0.0.1:5555"
    # Engine-wide commands (set_vocabulary, set_fpm_worker_id, reset_prefix_cache, cancelling
    # another client's request) need the operator role. Without CURVE it belongs to ipc peers
    # running as the daemon's user (or root), as the kernel reports them; "auto" binds the
    # control ROUTER to an extra ipc path in a private directory when control_endpoint is tcp,
    # so that such peers have a way in (docs/security.md §2).
    operator_endpoint: Annotated[
        str, _help('Extra ipc endpoint for operators ("auto" = private path, "" = none).')
    ] = "auto"
    # Open connections to all the sockets of one process, past which a new one is refused.
    max_connections: Annotated[
        int,
        msgspec.Meta(ge=0),
        _help("Connections open at once per process before new ones are refused (0 = no cap)."),
    ] = 4096
    # CURVE (ZeroMQ's encryption and key authentication) on every socket the daemon binds,
    # with the client keys, and their roles, in curve_authorized_keys_file.
    curve_secret_key_file: Annotated[
        str, _help('The daemon\'s CURVE key pair (zmq certificate file; "" = no CURVE).')
    ] = ""
    curve_authorized_keys_file: Annotated[
        str, _help("Client public keys and roles admitted under CURVE, one per line.")
    ] = ""
    # False leaves the KV event and FPM publishers without CURVE, for subscribers (Dynamo's
    # KV router, llm-d) that cannot present a key.
    curve_publishers: Annotated[bool, _help("CURVE on the KV event and FPM publishers too.")] = True
    # Rank r uses `endpoint_for_rank(kv_events_endpoint, r)`. "" publishes no KV events, as
    # vLLM with `enable_kv_cache_events: false`: no PUB, no replay, nothing in `welcome`.
    kv_events_endpoint: (
        Annotated[
            str, _help('KV events PUB of rank 0 (rank r: port + r, or ipc path-r; "" = off).')
        ]
        | None
    ) = "tcp://127.0.0.1:5557"
    kv_events_connect: Annotated[
        bool, _help("KV event PUBs connect to a collector instead of binding.")
    ] = False
    # Rank r as for kv_events_endpoint.
    kv_replay_endpoint: Annotated[str, _help('KV replay ROUTER of rank 0 ("" = off).')] | None = (
        None
    )
    # Replay keeps the last this many KV event messages per rank.
    kv_replay_buffer: Annotated[
        int, msgspec.Meta(ge=1), _help("KV event messages kept for replay, per rank.")
    ] = 10000
    # The rest of a replay follows as the client reads.
    kv_replay_client_bytes: Annotated[
        int,
        msgspec.Meta(ge=1),
        _help("Replay bytes one client may have unread; a client that stops reading is dropped."),
    ] = 8 * 1024 * 1024
    kv_events_buffer_bytes: Annotated[
        int,
        msgspec.Meta(ge=1),
        _help("KV event bytes queued per slow subscriber, per rank, before it misses batches."),
    ] = 64 * 1024 * 1024
    # The first frame of every KV event message.
    kv_events_topic: Annotated[str, _help("Topic frame of KV event messages.")] = ""
    # "vllm": vLLM >= 0.24 tagged maps; "vllm-array": vLLM 0.22/0.23 positional arrays.
    kv_events_format: Annotated[
        KvEventsFormat, _help("vllm: 0.24+ maps; vllm-array: 0.22/0.23.")
    ] = "vllm"
    # Rank r as for kv_events_endpoint.
    fpm_endpoint: Annotated[str, _help('Forward-pass metrics PUB of rank 0 ("" = off).')] | None = (
        "tcp://127.0.0.1:20380"
    )
    # "" means the daemon uses f"{hostname}:{pid}" (resolved at startup).
    worker_id: Annotated[str, _help('FPM worker_id ("" = hostname:pid).')] = ""
    # Requests waiting to run per rank before `submit` answers `overloaded`. The default is
    # 16 batches of the default max_num_seqs (README "Limits and guarantees" says why).
    max_queued_requests: Annotated[
        int,
        msgspec.Meta(ge=0),
        _help("Waiting requests per rank before `overloaded` (0 = no limit)."),
    ] = 4096
    # What the requests one control client has in flight may hold in the daemon, as
    # engined.server.control.budgets charges them (state, prompt, planned ids); beyond it `submit`
    # answers `overloaded`. The default holds ~26M prompt tokens: a router that keeps every
    # rank of an 8-rank default daemon full (8M tokens) and as much again queued fits twice
    # over (README "Limits and guarantees").
    control_inflight_bytes: Annotated[
        int,
        msgspec.Meta(ge=1),
        _help("Bytes one control client's requests in flight may hold before `overloaded`."),
    ] = CONTROL_INFLIGHT_BYTES
    # What one control client that does not read may have queued in the daemon, encoded,
    # beyond its small ZeroMQ pipe; past it (or past 100,000 unread messages) the client is
    # dropped: its requests are cancelled, and it is told once it reads (PROTOCOL.md §1.4).
    control_unread_bytes: Annotated[
        int,
        msgspec.Meta(ge=1),
        _help("Bytes queued for one control client that does not read before it is dropped."),
    ] = CONTROL_UNREAD_BYTES
    # Then in-flight requests are cancelled.
    drain_timeout: Annotated[
        float, msgspec.Meta(ge=0.0), _help("Seconds to finish in-flight requests at shutdown.")
    ] = 30.0
    # 0: every rank in the daemon's own event loop; N: N worker processes (contiguous blocks of
    # ranks, at most one process per rank); -1 (the default): one per core the daemon may run
    # on, none when there is one rank or one core (nothing to spread). Clients see the same
    # sockets and protocol either way (docs/architecture.md, process layout).
    rank_processes: Annotated[
        int,
        msgspec.Meta(ge=-1),
        _help("Worker processes for the ranks (0 = the daemon's own, -1 = one per core)."),
    ] = -1
    # SCHED_FIFO at this priority for every thread of the daemon and of its rank workers
    # (engined.server.ranks.realtime), so that a paced pass starts on time on a busy machine. Needs
    # CAP_SYS_NICE or an RLIMIT_RTPRIO at least as high; only with engine.speedup_ratio > 0.
    realtime_priority: Annotated[
        int,
        msgspec.Meta(ge=0, le=99),
        _help("SCHED_FIFO priority of a paced daemon's threads (0 = normal scheduling)."),
    ] = 0
    # "auto" logs JSON when stderr is not a TTY and console lines when it is.
    log_format: Annotated[LogFormat, _help("auto: json unless stderr is a TTY.")] = "auto"
    log_level: Annotated[LogLevel, _help("Lowest level logged.")] = "info"
    # The HTTP server for Prometheus /metrics and /health; None = no HTTP server.
    http_port: Annotated[Port, _help('Port for /metrics and /health ("" = off).')] | None = None
    # Loopback by default, since /metrics is unauthenticated.
    http_host: Annotated[
        str,
        msgspec.Meta(min_length=1),
        _help("Address the /metrics and /health server listens on."),
    ] = "127.0.0.1"
    # Bearer keys of the HTTP server, vLLM's `--api-key`: required on the paths vLLM guards
    # (engined.server.ops.http_endpoint), and on /metrics with `api_key_metrics`. The text forms
    # (flag, ENGINED_API_KEY, and VLLM_API_KEY when no other layer gives a key) are one key each;
    # TOML takes one key or a list. Loading puts the keys of `api_key_file` here.
    api_key: (
        Annotated[
            tuple[str, ...],
            _help("Bearer key the HTTP server requires on vLLM's API paths (VLLM_API_KEY too)."),
        ]
        | None
    ) = None
    # Keys one per line, so that no secret sits on a command line or in the world-readable
    # config file the units need; refused when any user may read or write it.
    api_key_file: (
        Annotated[str, _help("File of API keys, one per line; mode 0600 or 0640.")] | None
    ) = None
    # An engined extension: vLLM leaves /metrics open whatever its keys.
    api_key_metrics: Annotated[
        bool, _help("Require the API key on /metrics too (vLLM leaves it open).")
    ] = False
    # --- The OpenAI-compatible API server: `engined serve` as `vllm serve` (engined.openai). ---
    # vLLM's MODEL: a local model directory, or a Hugging Face name found in the local cache;
    # the tokenizer, the chat template and the vocabulary the ranks draw from come from it, and
    # it is the served name unless model_name is set.
    model: Annotated[
        str, _help('Local model directory or a name in the HF cache ("" = the embedded model).')
    ] = ""
    # vLLM's `--served-model-name A B C`: A is model_name (responses and /metrics carry it),
    # B and C are further names requests may ask for. One per flag; TOML takes a list.
    model_aliases: Annotated[
        tuple[str, ...], _help("Further served names (vLLM's further --served-model-name values).")
    ] = ()
    tokenizer: Annotated[
        str, _help('Tokenizer, when not the model\'s ("builtin" = the embedded one).')
    ] = ""
    # vLLM's `--lora-modules`: the LoRA adapters every API server process serves from its
    # start, each `name=path` or vLLM's JSON object (engined.config.lora_modules); they need
    # engine.enable_lora, as in vLLM. Requests name them in `model`; the daemon reads no path.
    lora_modules: Annotated[
        tuple[str, ...],
        _help(
            "LoRA adapters the API servers serve from their start, as vLLM's --lora-modules: "
            'each name=path or {"name", "path", "base_model_name"} JSON (needs --enable-lora).'
        ),
    ] = ()
    # vLLM binds every interface by default ("" here), which a pod's readiness probe needs.
    api_host: Annotated[
        str, _help('Address the OpenAI API listens on ("" = every interface, as vLLM).')
    ] = ""
    api_port: (
        Annotated[
            int, msgspec.Meta(ge=0, le=65535), _help('Port of the OpenAI API ("" = no API server).')
        ]
        | None
    ) = 8000
    # Each is its own process and control client of the daemon; none runs on the ranks' loop.
    api_server_count: Annotated[
        int, msgspec.Meta(ge=1, le=64), _help("OpenAI API server processes.")
    ] = 1
    enable_prompt_tokens_details: Annotated[
        bool, _help("Usage carries prompt_tokens_details (cached_tokens), as vLLM's flag.")
    ] = False
    max_logprobs: Annotated[
        int, msgspec.Meta(ge=-1), _help("Most logprobs a request may ask for (-1 = vocabulary).")
    ] = 20
    stream_interval: Annotated[
        int,
        msgspec.Meta(ge=1),
        _help(
            "Tokens a streamed choice gathers before it is sent, as vLLM's --stream-interval "
            "(its first output and its last are sent at once; a request may ask for more)."
        ),
    ] = 1
    enable_server_load_tracking: Annotated[
        bool,
        _help("Count each API server's requests in flight for GET /load, as vLLM's flag."),
    ] = False
    sse_keep_alive_interval: Annotated[
        int,
        msgspec.Meta(ge=0),
        _help(
            "Seconds a streamed completion or chat may send nothing before it sends an SSE "
            "keep-alive comment, as vLLM's flag (0 = never)."
        ),
    ] = 0
    response_role: Annotated[
        str,
        msgspec.Meta(min_length=1, max_length=256),
        _help(
            "The role of a chat's answer when its request adds the generation prompt, as "
            "vLLM's --response-role."
        ),
    ] = "assistant"
    return_tokens_as_token_ids: Annotated[
        bool,
        _help(
            "Logprobs name tokens `token_id:{id}` rather than by their text, unless a request "
            "says otherwise, as vLLM's flag."
        ),
    ] = False
    enable_force_include_usage: Annotated[
        bool,
        _help(
            "Every streamed response carries usage, on each chunk and in a last chunk, "
            "whatever its stream_options, as vLLM's flag."
        ),
    ] = False
    # vLLM's CORS flags (engined.openai.cors); on the command line and in the environment a
    # list is vLLM's JSON array of strings.
    allowed_origins: Annotated[
        tuple[str, ...],
        msgspec.Meta(max_length=1024),
        _help(
            'Origins a browser may call the API from (JSON list; "*" = any), as vLLM\'s '
            "--allowed-origins (none by default: cross-origin access is disabled)."
        ),
    ] = ()
    allowed_methods: Annotated[
        tuple[str, ...],
        msgspec.Meta(max_length=1024),
        _help('Methods a CORS preflight may ask for (JSON list; "*" = any), as vLLM\'s flag.'),
    ] = ("*",)
    allowed_headers: Annotated[
        tuple[str, ...],
        msgspec.Meta(max_length=1024),
        _help('Headers a CORS preflight may ask for (JSON list; "*" = any), as vLLM\'s flag.'),
    ] = ("*",)
    allow_credentials: Annotated[
        bool, _help("CORS answers allow credentials (cookies), as vLLM's --allow-credentials.")
    ] = False
    enable_request_id_headers: Annotated[
        bool,
        _help(
            "Every API response carries X-Request-Id: the request's own, else a fresh uuid, "
            "as vLLM's flag."
        ),
    ] = False
    # vLLM's admission control in the API servers (engined.openai.queue_admission).
    max_num_queued_reqs: (
        Annotated[
            int,
            msgspec.Meta(ge=0),
            _help(
                "Engine requests the API servers hold at once, all processes together; "
                'beyond it a request gets 503, as vLLM\'s ("" = no limit).'
            ),
        ]
        | None
    ) = None
    max_num_queued_tokens: (
        Annotated[
            int,
            msgspec.Meta(ge=0),
            _help(
                "Prompt tokens an API server process holds waiting for their first output; "
                'at or beyond it a request gets 503, as vLLM\'s ("" = no limit).'
            ),
        ]
        | None
    ) = None
    # The simulation (engined.core.args); TOML table `[engine]`.
    engine: EngineArgs = _DEFAULT_ENGINE


class ConfigError(Exception):
    """A setting cannot be used. The message starts with the key (or file) it is about.

    Loading reports every bad setting of a configuration at once: then the message has one
    line per problem, in the order found, and `problems` holds each one's own error.

    Attributes:
        key: dotted config key (`engine.block_size`, `control_endpoint`) of the first
            problem, or None when it is not one setting (an unreadable file, an unknown
            environment variable).
        problems: the errors this one reports, itself alone when it is a single problem.
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.problems: tuple[ConfigError, ...] = (self,)

    @classmethod
    def of(cls, problems: list[ConfigError]) -> ConfigError:
        """One error reporting every problem of `problems` (not empty), a line each."""
        if len(problems) == 1:
            return problems[0]
        error = cls("\n".join(str(p) for p in problems), key=problems[0].key)
        error.problems = tuple(problems)
        return error
