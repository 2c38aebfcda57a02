"""`rstar2 serve`'s stop marks Crashed the flow runs its worker left unfinished, through Prefect's client against a
real Prefect server (cli/supervisor.py `crash_orphaned_runs`): only its own work pool's running or pending runs, the
others left as they are; with the server gone, one line says nothing could be marked."""

from prefect.client.schemas.actions import WorkPoolCreate
from prefect.states import Completed, Pending, Running

from rstar2.cli import supervisor
from rstar2.core.net import free_port


def test_the_pool_s_unfinished_runs_are_crashed_and_nothing_else(tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    started = []
    try:
        supervisor.start_prefect(port, tmp_path / "prefect.log", started, env={"PREFECT_HOME": str(tmp_path)})
        with supervisor.prefect_client(api) as client:
            runs = {}
            for pool in (supervisor.POOL, "another-pool"):
                client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
                flow = client.create_flow_from_name(f"flow-{pool}")
                deployment = client.create_deployment(flow_id=flow, name="d", work_pool_name=pool)
                for kind in ("running", "pending", "completed"):
                    runs[pool, kind] = client.create_flow_run_from_deployment(deployment).id
            for (pool, kind), run_id in runs.items():  # a run made from a deployment waits as Scheduled
                client.set_flow_run_state(run_id, {"running": Running, "pending": Pending,
                                                   "completed": Completed}[kind](), force=True)

            marked = supervisor.crash_orphaned_runs(api, "serve stopped")

            assert sorted(marked) == sorted(str(runs[supervisor.POOL, k]) for k in ("running", "pending"))
            states = {key: client.read_flow_run(run_id).state for key, run_id in runs.items()}
        assert {k: s.type.value for k, s in states.items()} == {
            (supervisor.POOL, "running"): "CRASHED", (supervisor.POOL, "pending"): "CRASHED",
            (supervisor.POOL, "completed"): "COMPLETED", ("another-pool", "running"): "RUNNING",
            ("another-pool", "pending"): "PENDING", ("another-pool", "completed"): "COMPLETED"}
        assert states[supervisor.POOL, "running"].message == "serve stopped"
    finally:
        supervisor.stop_tree([p for s in started for p in supervisor.tree(s)], supervisor.SERVER_GRACE_S)
    said = []
    supervisor._crash_orphans(api, "SIGTERM", said.append)  # the server is gone: one line, no traceback
    assert len(said) == 1 and said[0].startswith("could not mark interrupted runs crashed: ")
