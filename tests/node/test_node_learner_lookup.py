"""A node looking for its job's learner (a learner restarting after a crash) asks the coordinator
by registering again: every such lookup is admitted by a real coordinator's default registration
budget (12 a minute, a burst of 3; the node's pacer spaces them), and a job that ended meanwhile
ends the lookup with :class:`JobGone` instead of a node retrying for minutes. Found by
tests/e2e/test_learner_fsdp_e2e.py in CI: the lookup that would have found the restarted learner
was refused over the budget, and the node exited."""

from __future__ import annotations

import pytest
import trio
from rich.console import Console

from echo.node.display import Display
from echo.node.errors import JobGone
from echo.node.session import CoordinatorSession
from echo.tools.peer_kit import register_record
from tests.conftest import run_with_coordinator
from tests.coordinator.test_coordinator import start_job

pytestmark = pytest.mark.slow  # the pacer spaces the fourth lookup by 6 s


def test_lookups_stay_inside_the_registration_budget_and_an_ended_job_ends_them(tmp_path) -> None:
    async def body(coord, client) -> None:
        job_id, learner = await start_job(coord, client)
        node = await client()  # its host; the session below speaks as the node does
        session = CoordinatorSession(node.identity, Display(Console(quiet=True)), lambda: None)

        session.describe = lambda: register_record(node.host.listen_multiaddrs)
        await session.connect(node.host, coord.multiaddrs[0])
        # The burst and one more: each answered with the learner's addresses, none refused.
        for _ in range(4):
            with trio.fail_after(15):
                addrs = await session.learner_addrs(job_id)
            assert addrs == learner.host.listen_multiaddrs
        coord.store.set_job_status(job_id, "done")
        with pytest.raises(JobGone):
            await session.learner_addrs(job_id)

    run_with_coordinator(tmp_path, body)
