"""Protocol version, stream protocol ids and gossip topics: the names both sides must agree on."""

# Bump on any incompatible change to a message in echo.protocol.messages; peers with another
# major version are refused at registration with a clear message.
# 2: versions reach nodes down a coordinator-planned relay tree (Register.addrs, NodeStatus
#    .upload_bps, StepAck.plan, broadcast.PlanAnnouncement on TOPIC_VERSIONS, PROTO_BAD_PEER).
# 3: stripes carry unequal shares of a version's chunks (broadcast.Route / BroadcastPlan /
#    PushHello .weights, stripe_table; /echo/push/1.1.0).
# 4: messages.TrainingGroup no longer carries the node's signed envelope (the learner never read
#    it; the coordinator builds batches from the groups it stored decoded); JobInfo.staleness
#    may be 0 (synchronous jobs).
# 5: Lease.prompt_tokens (nodes generate from the signed lease's token ids, not from task code);
#    BatchReply.more, and batch replies up to limits.MAX_BATCH_REPLY_BYTES (long completions).
# 6: one swarm, many jobs: Register.cost (the volunteer's declared cost), RegisterReply
#    .assigned_job and LeaseReply.assigned_job (the coordinator's scheduler places each node on
#    one job, or on standby, and moves it).
# 7: reachability.PunchRequest / PunchReply on PROTO_PUNCH (coordinator -> a node behind NAT:
#    open a direct connection to this other node now). Additive on the wire, but the go signal
#    goes to both nodes at once: a v6 node refuses the stream and its partner punches alone
#    until its timeout, so the swarm is kept on one punch-capable build.
# 8: learner epochs: LearnerHello / BatchRequest / StepReport .epoch, issued by the coordinator;
#    a request with any but the job's newest is refused (code messages.LEARNER_EPOCH_REFUSED).
#    JobInfo.task.params no longer carries file paths (jobspec.node_task_params).
# 9: a TrainingGroup carries the group in the form the learner trains on (token ids and
#    log-probs as lists, messages.TrainingCompletion), encoded once when the coordinator accepts
#    it: the learner no longer unpacks the node's arrays a second time (issue 29).
# 10: LoRA jobs: Manifest.adapter (messages.AdapterRef: the base model's digest, rank, alpha,
#     modules); such a version's payload is the adapter (version 0 carries the base too) and its
#     state digest binds base and adapter, so a v9 node could not apply or report it.
PROTOCOL_VERSION = 10

# What nodes and the coordinator say they run (registration, the welcome line, status files).
SOFTWARE = "echo-swarm/0.1.0"

# libp2p stream protocols (request/response, one frame each way).
PROTO_REGISTER = "/echo/register/1.0.0"  # node -> coordinator
PROTO_LEASE = "/echo/lease/1.0.0"  # node -> coordinator
PROTO_SUBMIT = "/echo/submit/1.0.0"  # node -> coordinator
PROTO_MANIFEST = "/echo/manifest/1.0.0"  # anyone -> coordinator: latest signed manifest of a job
PROTO_CHUNK = "/echo/chunk/1.0.0"  # anyone -> any holder: a content-addressed chunk
PROTO_LEARNER_HELLO = "/echo/learner/hello/1.0.0"  # learner -> coordinator: attach to its job
PROTO_LEARNER_BATCH = "/echo/learner/batch/1.0.0"  # learner -> coordinator: take groups
PROTO_LEARNER_REPORT = "/echo/learner/report/1.0.0"  # learner -> coordinator: publish a version
PROTO_STATUS = "/echo/status/1.0.0"  # node -> coordinator: heartbeat with held version
PROTO_BAD_PEER = "/echo/bad-peer/1.0.0"  # node -> coordinator: a relay lied or stalled

# gossipsub topics: small announcements only, never bulk bytes.
# A coordinator-signed broadcast.PlanAnnouncement per version: the learner-signed manifest and
# the relay tree that carries it.
TOPIC_VERSIONS = "echo/versions/2"
