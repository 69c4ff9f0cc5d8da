"""Echo swarm test suite (a package so tests can share helpers like tests.adversaries)."""
