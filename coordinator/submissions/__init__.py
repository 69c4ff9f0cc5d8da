"""A submitted group's way in: verified (:mod:`.verify`: signatures, lease, tokens, versions),
scored in its job's sandbox off the event loop (:mod:`.scoring`), and booked (:mod:`.submit`,
the submit handler); what a misbehaving node costs itself (:mod:`.penalties`)."""
