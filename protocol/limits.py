"""Size limits applied before any allocation when decoding peer data.

They are generous for the messages the protocol defines and small next to a machine's memory, so a
hostile peer can make us read at most a few of these per stream before we close it.
"""

# A control message (register, lease, submission of one GRPO group) is well under this;
# 64 sequences x 4096 tokens x (4 B id + 4 B logprob) is 2 MiB.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024

# A learner's batch reply (messages.BatchReply) is the one bulk control message: the coordinator
# fits as many whole groups as this allows and says when more are waiting. 32 MiB holds one
# group at the protocol's extremes (256 completions of 8192 tokens, 16 MiB) and 58 groups of 16
# completions of 4096 tokens, more than a typical batch of 8.
MAX_BATCH_REPLY_BYTES = 32 * 1024 * 1024

# Weight chunks travel on their own protocol; 4 MiB keeps per-chunk hashing and re-fetch cheap
# while staying far from yamux's window sizes mattering.
MAX_CHUNK_BYTES = 4 * 1024 * 1024

# A learner-signed manifest of 65536 chunks (messages.Manifest's limit) is ~3 MiB.
MAX_MANIFEST_ENVELOPE_BYTES = 4 * 1024 * 1024

# A patch or anchor never decodes to more than this (64 GiB, above any model a volunteer serves);
# a manifest or patch claiming more is refused before any work.
MAX_STATE_BYTES = 64 << 30

# A frame carries one message or one chunk plus a small header.
MAX_FRAME_BYTES = MAX_CHUNK_BYTES + 64 * 1024

# msgpack structure limits: no message nests deeper than this or holds longer containers.
MAX_DEPTH = 16
MAX_ARRAY_LEN = 1 << 16
MAX_MAP_LEN = 1024
MAX_STR_LEN = 1 << 20
MAX_BIN_LEN = MAX_MESSAGE_BYTES

# zstd output cap for any compressed message; patches carry their own, larger caps.
MAX_DECOMPRESSED_BYTES = 64 * 1024 * 1024
