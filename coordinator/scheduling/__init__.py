"""Which job each node serves and how much of it it holds.

:mod:`.assign` (pure) places nodes on jobs by the ECHO-2 capacity model (:mod:`.capacity`),
with what fits a node and how fast it would run (:mod:`.fit`, pure) and the per-job terms as
measured (:mod:`.measure`); :mod:`.inputs` gathers each pass's inputs (what each job needs, what
each node counts for there, bounded by what it delivered); :mod:`.placement` applies the
decisions as jobs and nodes come and go and answers the node RPCs from them; and
:mod:`.leases` mints the signed leases that carry a node's share of a job's work."""
