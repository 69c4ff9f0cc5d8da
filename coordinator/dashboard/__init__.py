"""The operator's and volunteers' dashboard: its HTTP routes (:mod:`.routes`: the static page,
the live feeds and the public credit endpoints), the snapshots it draws from the coordinator's
state (:mod:`.data`), the server-sent-event feed shared by every viewer (:mod:`.live`), and the
static bundle itself, beside them (page, script, style, the vendored uPlot with its licence)."""
