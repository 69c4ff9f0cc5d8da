"""Jobs on a running coordinator: each job's runtime context (spec, task, tokenizer,
verification state: :mod:`.context`), submitting, resuming and cancelling them
(:mod:`.control`), the supervised learner subprocess of each (:mod:`.learners`), and the names
that may appear in paths (:mod:`.names`)."""
