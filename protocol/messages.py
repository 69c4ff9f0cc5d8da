"""The messages of DESIGN.md's flows as typed, strictly validated records.

Each record is a frozen pydantic model with ``extra="forbid"`` and strict types, so a field of the
wrong type, an unknown field or an out-of-range value is a :class:`SchemaError`, never a silent
coercion. Token ids and log-probs travel as packed little-endian arrays (int32 / float32) rather
than msgpack lists: they are the bulk of a submission, and numpy checks them in microseconds.

Records are encoded with :func:`encode` (canonical msgpack of the fields in declared order) and
decoded with :func:`decode`; signed records go through :mod:`echo.protocol.signing`. A record
that is ever signed names its envelope kind in the class constant ``KIND`` (a class variable,
not a field: it is not part of the body), which :func:`~echo.protocol.signing.seal_record`
signs it as and :func:`~echo.protocol.signing.open_record` demands.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from echo.protocol import codec
from echo.protocol.errors import SchemaError

Hash32 = Annotated[bytes, Field(min_length=32, max_length=32)]
PubKey = Annotated[bytes, Field(min_length=32, max_length=32)]
ShortStr = Annotated[str, Field(max_length=256)]
Id = Annotated[str, Field(min_length=1, max_length=128)]
Version = Annotated[int, Field(ge=0, le=2**40)]

# Per-completion bounds; a lease narrows them further (max_new_tokens).
MAX_COMPLETION_TOKENS = 8192
MAX_GROUP_SIZE = 256
# Longest prompt a lease or a training group carries: 32 KiB of int32 ids per lease, so a reply
# of 64 leases stays near 2 MiB, well inside a frame.
MAX_PROMPT_TOKENS = 8192


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # The envelope kind of a record that is signed; only those records define it.
    KIND: ClassVar[str]

    def to_obj(self) -> dict[str, Any]:
        return self.model_dump(mode="python")


R = TypeVar("R", bound=Record)


def encode(record: Record) -> bytes:
    return codec.packb(record.to_obj())


def from_obj(cls: type[R], obj: Any) -> R:
    """Validate a decoded object as ``cls``; raises SchemaError naming the bad field."""
    if not isinstance(obj, dict):
        raise SchemaError(f"{cls.__name__}: expected a map, got {type(obj).__name__}")
    try:
        return cls.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise SchemaError(f"{cls.__name__}.{where}: {first['msg']}") from None


def decode(cls: type[R], data: bytes, **limits: Any) -> R:
    return from_obj(cls, codec.unpackb(data, **limits))


# ---------------------------------------------------------------- node <-> coordinator


class Hardware(Record):
    cpu_count: int = Field(ge=0, le=4096)
    ram_bytes: int = Field(ge=0)
    gpu: ShortStr = ""
    vram_bytes: int = Field(default=0, ge=0)
    os: ShortStr = ""
    python: ShortStr = ""


class Register(Record):
    """Signed by the node's identity key; the signer must be the Noise-authenticated peer."""

    KIND: ClassVar[str] = "register"

    protocol_version: int
    software: ShortStr
    engine: ShortStr
    hardware: Hardware
    tokens_per_s: float = Field(ge=0, allow_inf_nan=False)
    upload_bps: float = Field(ge=0, allow_inf_nan=False)
    download_bps: float = Field(ge=0, allow_inf_nan=False)
    timestamp: float = Field(allow_inf_nan=False)
    # Where peers reach this node to push versions to it (its listen multiaddrs).
    addrs: list[ShortStr] = Field(default_factory=list, max_length=8)
    # Protocol 6: what an hour of this node costs, in the operator's units (``echo-node join
    # --cost``); the scheduler activates the cheapest nodes per unit of throughput first.
    cost: float = Field(default=1.0, ge=0, le=1e9, allow_inf_nan=False)


class TaskRef(Record):
    name: ShortStr
    params: dict[str, int | float | str | bool] = Field(default_factory=dict, max_length=64)


class JobInfo(Record):
    """What a node needs to serve a job: model, task, learner identity, version source."""

    job_id: Id
    model: dict[str, Any]
    task: TaskRef
    publish_dtype: Literal["float32", "bfloat16", "float16"]
    learner_public_key: PubKey
    learner_peer_id: ShortStr
    learner_addrs: list[ShortStr] = Field(max_length=16)
    group_size: int = Field(ge=1, le=MAX_GROUP_SIZE)
    max_new_tokens: int = Field(ge=1, le=MAX_COMPLETION_TOKENS)
    staleness: int = Field(ge=0, le=1024)  # 0: synchronous (protocol 4)
    current_version: int = Field(ge=-1)


# RegisterReply.message when a job is submitted or runs but has not published version 0 yet
# (its learner is loading the model), or the node is placed on a job that is not listed yet.
JOB_STARTING = "a job is starting"


class RegisterReply(Record):
    """The running jobs, and (protocol 6) the one the coordinator's scheduler placed the node
    on: ``assigned_job`` is one of ``jobs``' ids, or "" when the node has nothing to do (no job
    runs, none fits it, or it stands by because the jobs have the throughput they need;
    ``message`` says which). ``base_jobs`` (issue 28) are the running LoRA jobs that share the
    assigned job's base model: the node may take their leases too, switching adapters on the
    base it holds rather than loading another model."""

    node_id: Id
    jobs: list[JobInfo] = Field(max_length=64)
    message: ShortStr = ""
    assigned_job: Annotated[str, Field(max_length=128)] = ""
    base_jobs: list[Annotated[str, Field(max_length=128)]] = Field(default=[], max_length=64)


class LeaseRequest(Record):
    """Signed by the node. ``have_version`` is the policy version its engine holds."""

    KIND: ClassVar[str] = "lease_request"

    job_id: Id
    max_leases: int = Field(ge=1, le=64)
    have_version: int = Field(ge=-1)
    timestamp: float = Field(allow_inf_nan=False)


class SamplingSpec(Record):
    max_new_tokens: int = Field(ge=1, le=MAX_COMPLETION_TOKENS)
    temperature: float = Field(gt=0, le=10, allow_inf_nan=False)
    top_p: float = Field(gt=0, le=1, allow_inf_nan=False)
    seed: int = Field(ge=0, lt=2**63)


class Lease(Record):
    """Signed by the coordinator: one GRPO group of ``group_size`` samples of one prompt.

    ``prompt_tokens`` (protocol 5) is the prompt as the model sees it (chat template applied),
    packed int32 little-endian: the coordinator computes it from its own copy of the task, so a
    node generates from it without the dataset or any task code. It is signed with the rest of
    the lease; the coordinator never takes prompt tokens back from a node.
    """

    KIND: ClassVar[str] = "lease"

    lease_id: Id
    job_id: Id
    node_id: Id
    prompt_id: int = Field(ge=0, lt=2**62)
    prompt_tokens: bytes = Field(min_length=4, max_length=4 * MAX_PROMPT_TOKENS)
    group_size: int = Field(ge=1, le=MAX_GROUP_SIZE)
    sampling: SamplingSpec
    min_version: int = Field(ge=0)
    issued_at: float = Field(allow_inf_nan=False)
    deadline: float = Field(allow_inf_nan=False)


class LeaseReply(Record):
    """Leases, or none and when to ask again. ``assigned_job`` (protocol 6) is None while the
    node stays on the job it asked for; otherwise the scheduler moved it: to that job, or to
    standby when "" (the node registers again to learn the job's details)."""

    leases: list[bytes] = Field(max_length=64)  # signed Lease envelopes
    current_version: int = Field(ge=-1)
    retry_after_s: float = Field(ge=0, le=3600, allow_inf_nan=False)
    message: ShortStr = ""
    assigned_job: Annotated[str, Field(max_length=128)] | None = None


class CompletionRecord(Record):
    token_ids: bytes = Field(max_length=4 * MAX_COMPLETION_TOKENS)  # int32 little-endian
    logprobs: bytes = Field(max_length=4 * MAX_COMPLETION_TOKENS)  # float32 little-endian
    finish_reason: Literal["stop", "length"]


class Submission(Record):
    """Signed by the node: the whole group of a lease, generated at ``version``."""

    KIND: ClassVar[str] = "submission"

    lease_id: Id
    job_id: Id
    version: Version
    engine: ShortStr
    state_digest: ShortStr
    completions: list[CompletionRecord] = Field(min_length=1, max_length=MAX_GROUP_SIZE)
    claimed_rewards: list[float] = Field(default_factory=list, max_length=MAX_GROUP_SIZE)
    gen_seconds: float = Field(ge=0, allow_inf_nan=False)


class SubmitReply(Record):
    accepted: bool
    reason: ShortStr
    detail: ShortStr = ""
    accepted_total: int = 0
    rejected_total: int = 0
    rejected_by_reason: dict[str, int] = Field(default_factory=dict, max_length=64)


class NodeStatus(Record):
    """Signed heartbeat: which version the node holds and how fast it is."""

    KIND: ClassVar[str] = "node_status"

    job_id: Id
    version: int = Field(ge=-1)
    state_digest: ShortStr
    tokens_per_s: float = Field(ge=0, allow_inf_nan=False)
    timestamp: float = Field(allow_inf_nan=False)
    # The node's measured push rate to its relay children (0: not measured yet).
    upload_bps: float = Field(default=0.0, ge=0, allow_inf_nan=False)


# ---------------------------------------------------------------- versions and chunks


class ChunkRef(Record):
    sha256: Hash32
    size: int = Field(ge=0)


class AdapterRef(Record):
    """What a LoRA version (protocol 9) is an adapter of, and how it applies.

    ``base_digest`` is the state digest (``echo.models.weights.state_digest``) of the base model
    the adapter is trained on; ``carries_base`` marks the one version whose payload holds the
    base's tensors beside the adapter's (version 0), which a node fetches once. The manifest's
    ``state_digest`` is then ``echo.models.lora.lora_digest(base_digest, adapter digest)``: a node
    serving the base alone, or another adapter, reports a digest that differs.
    """

    base_digest: ShortStr
    rank: int = Field(ge=1, le=1024)
    alpha: float = Field(gt=0, le=1e6, allow_inf_nan=False)
    target_modules: list[ShortStr] = Field(min_length=1, max_length=16)
    carries_base: bool = False


class Manifest(Record):
    """Signed by the learner's key, which nodes pin from the job.

    ``KIND`` is the envelope kind; the field ``kind`` says whether the version is an anchor or
    a patch. ``adapter`` (protocol 9) is set for a LoRA job: the payload then holds the adapter's
    tensors (and, where ``adapter.carries_base``, the base's), and patches change the adapter.
    """

    KIND: ClassVar[str] = "manifest"

    job_id: Id
    version: Version
    base_version: int = Field(ge=-1)  # -1 for a full anchor
    kind: Literal["anchor", "patch"]
    total_size: int = Field(ge=0)
    chunks: list[ChunkRef] = Field(max_length=65536)
    tensor_digests: dict[str, str] = Field(max_length=4096)
    state_digest: ShortStr
    anchor_version: int = Field(ge=0)  # the newest anchor at or before this version
    created_at: float = Field(allow_inf_nan=False)
    adapter: AdapterRef | None = None


class ManifestRequest(Record):
    job_id: Id
    version: int = Field(ge=-1)  # -1: the latest


class ChunkRequest(Record):
    sha256: Hash32


# ---------------------------------------------------------------- learner <-> coordinator


# The code of the error a coordinator answers a learner request with when the request's epoch
# is not the job's newest (the learner was superseded, or its epoch was never issued): the
# learner stops for good rather than retry (protocol 8).
LEARNER_EPOCH_REFUSED = "learner_epoch"
# The learner epoch a request carries (protocol 8): the number the coordinator issued when it
# started this learner, or when its operator handed the job to an external one
# (coordinator/store/epochs.py). 0: none issued, accepted only while the job has never issued one.
LearnerEpoch = Annotated[int, Field(ge=0, le=2**40)]


class LearnerHello(Record):
    """Signed by the learner's key (the one the job pins): where nodes fetch its chunks."""

    KIND: ClassVar[str] = "learner_hello"

    job_id: Id
    peer_id: ShortStr
    addrs: list[ShortStr] = Field(max_length=16)
    timestamp: float = Field(allow_inf_nan=False)
    epoch: LearnerEpoch = 0


class LearnerHelloReply(Record):
    current_version: int = Field(ge=-1)
    cancelled: bool = False


class BatchRequest(Record):
    """Signed by the learner: accepted groups not yet trained, no older than ``min_version``."""

    KIND: ClassVar[str] = "batch_request"

    job_id: Id
    max_groups: int = Field(ge=1, le=4096)
    min_version: int = Field(ge=0)
    timestamp: float = Field(allow_inf_nan=False)
    epoch: LearnerEpoch = 0


class TrainingCompletion(Record):
    """One completion of an accepted group in the form the learner trains on (protocol 9): the
    token ids and log-probs the coordinator verified, as lists, so the learner decodes the
    node's packed arrays no second time. The learner trusts the coordinator for the ids' range
    (its GRPO step still refuses an id outside the vocabulary before it indexes anything)."""

    token_ids: list[int] = Field(min_length=1, max_length=MAX_COMPLETION_TOKENS)
    logprobs: list[float] = Field(min_length=1, max_length=MAX_COMPLETION_TOKENS)
    finish_reason: Literal["stop", "length"]


class TrainingGroup(Record):
    """One accepted group as the learner trains on it, encoded once when the coordinator
    accepted it and handed out as stored (:func:`encode_batch_reply`).

    Protocol 4 dropped ``envelope`` (the node's whole signed Submission, sent again with every
    group and never read by the learner); the coordinator keeps it for audit. Protocol 9 carries
    the prompt (as the lease carried it, rendered once when the lease was issued) and the
    completions as lists.
    """

    rollout_id: Id
    node_id: Id
    prompt_id: int = Field(ge=0)
    prompt_tokens: list[int] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    version: Version
    engine: ShortStr
    rewards: list[float] = Field(max_length=MAX_GROUP_SIZE)
    completions: list[TrainingCompletion] = Field(max_length=MAX_GROUP_SIZE)


# Encoded size of a TrainingGroup beyond its token ids and log-probs: field names, its strings
# at their longest (UTF-8, 4 bytes a character), headers, and per completion its reward and the
# map around its lists. tests/protocol/test_protocol.py checks the bound against real encodings.
_GROUP_OVERHEAD = 4096
_COMPLETION_OVERHEAD = 96
# At most, in msgpack: a token id 5 bytes (an int32), a log-prob 9 (a double).
_ID_BYTES = 5
_LOGPROB_BYTES = 9


def training_group_bound(group_size: int, max_new_tokens: int) -> int:
    """The most bytes one encoded :class:`TrainingGroup` of ``group_size`` completions of at most
    ``max_new_tokens`` tokens can take (a prompt of up to ``MAX_PROMPT_TOKENS`` included): what
    a batch reply budgets per group before it reads any group."""
    per_completion = (_ID_BYTES + _LOGPROB_BYTES) * max_new_tokens + _COMPLETION_OVERHEAD
    return _ID_BYTES * MAX_PROMPT_TOKENS + _GROUP_OVERHEAD + group_size * per_completion


class BatchReply(Record):
    """Up to a request's ``max_groups`` groups, as many as fit one reply's byte budget
    (``limits.MAX_BATCH_REPLY_BYTES``). ``more`` (protocol 5): the budget, not the buffer, cut
    this reply short, so the learner asks again at once for the rest."""

    groups: list[TrainingGroup] = Field(max_length=4096)
    current_version: int = Field(ge=-1)
    cancelled: bool = False
    more: bool = False


def encode_batch_reply(
    groups: list[bytes], current_version: int, *, cancelled: bool = False, more: bool = False
) -> bytes:
    """``encode(BatchReply(...))`` of ``groups``, each an encoded :class:`TrainingGroup` as the
    coordinator stored it when it accepted the group: the groups are not decoded again."""
    return codec.packb_fields(
        [
            ("groups", None),
            ("current_version", current_version),
            ("cancelled", cancelled),
            ("more", more),
        ],
        encoded="groups",
        items=groups,
    )


class RescoreVerdict(Record):
    rollout_id: Id
    ok: bool
    reason: ShortStr = ""
    stats: dict[str, float] = Field(default_factory=dict, max_length=32)


class StepReport(Record):
    """Signed by the learner: version ``manifest.version`` trained exactly ``trained`` rollouts."""

    KIND: ClassVar[str] = "step_report"

    job_id: Id
    version: Version
    manifest: bytes  # signed Manifest envelope
    trained: list[Id] = Field(max_length=4096)
    verdicts: list[RescoreVerdict] = Field(default_factory=list, max_length=4096)
    metrics: dict[str, float] = Field(default_factory=dict, max_length=64)
    epoch: LearnerEpoch = 0


class StepAck(Record):
    ok: bool
    message: ShortStr = ""
    # To a step report: the coordinator-signed broadcast.PlanAnnouncement of the new version
    # (empty: no plan, nodes pull); the learner pushes to its children in it.
    plan: bytes = Field(default=b"", max_length=4 << 20)


# ---------------------------------------------------------------- packed arrays


def pack_tokens(ids: Any) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def pack_logprobs(values: Any) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_tokens(data: bytes, *, vocab_size: int, max_len: int) -> np.ndarray:
    """Token ids from packed int32; SchemaError unless every id is in ``[0, vocab_size)``."""
    if len(data) % 4:
        raise SchemaError("token array length is not a multiple of 4")
    if len(data) // 4 > max_len:
        raise SchemaError(f"{len(data) // 4} tokens exceed the limit of {max_len}")
    arr = np.frombuffer(data, dtype="<i4")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
        raise SchemaError(f"token id outside the vocabulary of {vocab_size}")
    return arr


def unpack_logprobs(data: bytes, *, max_len: int) -> np.ndarray:
    """Log-probs from packed float32; SchemaError unless all are finite and <= 0."""
    if len(data) % 4:
        raise SchemaError("log-prob array length is not a multiple of 4")
    if len(data) // 4 > max_len:
        raise SchemaError(f"{len(data) // 4} log-probs exceed the limit of {max_len}")
    arr = np.frombuffer(data, dtype="<f4")
    if arr.size and (not np.isfinite(arr).all() or float(arr.max()) > 1e-4):
        raise SchemaError("log-probs must be finite and not above 0")
    return arr
