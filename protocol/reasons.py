"""Stable reason codes for every rejection: part of the wire contract.

A reason code travels in :class:`~echo.protocol.messages.SubmitReply` (``reason`` and the keys of
``rejected_by_reason``) from the coordinator to nodes, which show them to volunteers, and in
:class:`~echo.protocol.messages.RescoreVerdict` from the learner to the coordinator, which stores
and counts them per node. The strings are therefore part of the protocol: renaming one is a
protocol change, and every producer and consumer imports the constants from here, never a
bare string.

``COUNTS_AGAINST`` are failures of the node's work (they reset its reputation streak); the rest
are ordinary races of a distributed system (a lease that expired while a slow node worked) or,
like ``UNSCORABLE``, the learner's own limits.
"""

# ---------------------------------------------------------------- coordinator (steps 1-4)
MALFORMED = "malformed"  # not msgpack / not an envelope / over the size limits
SCHEMA = "schema"  # fields of the wrong type or out of range
SIGNATURE = "signature"  # the signature does not verify
WRONG_SIGNER = "wrong_signer"  # signed by a key other than the authenticated peer's
UNKNOWN_NODE = "unknown_node"  # not registered
NODE_EXCLUDED = "node_excluded"  # excluded after repeated failures
RATE_LIMITED = "rate_limited"
UNKNOWN_LEASE = "unknown_lease"
LEASE_NOT_YOURS = "lease_not_yours"
DUPLICATE = "duplicate"  # lease already used, or the same content already accepted
LEASE_EXPIRED = "lease_expired"
JOB_MISMATCH = "job_mismatch"
STALE_VERSION = "stale_version"  # outside the job's staleness window
FUTURE_VERSION = "future_version"  # a version the learner has not published
BELOW_MIN_VERSION = "below_min_version"  # older than the lease demanded
INCOMPLETE_GROUP = "incomplete_group"  # not the whole GRPO group of the lease
BAD_TOKENS = "bad_tokens"  # ids outside the vocabulary, or over the length limit
BAD_LOGPROBS = "bad_logprobs"  # not finite, positive, or not one per token
BAD_TERMINATION = "bad_termination"  # finish reason does not match the tokens
WRONG_WEIGHTS = "wrong_weights"  # state digest differs from the published version's
REWARD_MISMATCH = "reward_mismatch"  # claimed rewards differ from the ones recomputed here

# ---------------------------------------------------------------- learner (step 5, re-scoring)
RESCORE_MISMATCH = "rescore_mismatch"  # log-probs disagree with the claimed version's
SAMPLING_SHAPE = "sampling_shape"  # chosen tokens too improbable to be the policy's samples
TERMINATION_IMPROBABLE = "termination_improbable"  # stopped where the policy would not
# The learner could not score the group (it no longer holds the claimed version's weights):
# the rollout is dropped without holding it against its node.
UNSCORABLE = "unscorable"

# ---------------------------------------------------------------- not a failure
# The group was valid and its node is credited, but its samples all scored the same: no
# advantage to train on (the job's ``skip_uniform_groups``). Never sent to a node.
UNIFORM = "uniform"

COUNTS_AGAINST = frozenset(
    {
        MALFORMED,
        SCHEMA,
        SIGNATURE,
        WRONG_SIGNER,
        LEASE_NOT_YOURS,
        DUPLICATE,
        JOB_MISMATCH,
        FUTURE_VERSION,
        BELOW_MIN_VERSION,
        INCOMPLETE_GROUP,
        BAD_TOKENS,
        BAD_LOGPROBS,
        BAD_TERMINATION,
        WRONG_WEIGHTS,
        REWARD_MISMATCH,
        RESCORE_MISMATCH,
        SAMPLING_SHAPE,
        TERMINATION_IMPROBABLE,
    }
)
