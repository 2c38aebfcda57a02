"""A step that died after its commit, before its periodic evaluation (eval.every), gets it on resume
(flows/train_stage.py `_redo_step_evals`): only steps due an evaluation and lacking one, each from its own checkpoint,
the engines on the last checkpoint after. The real path (a campaign killed once step 1's checkpoint is committed,
then resumed: eval_pass1 logged for both steps as without the kill) was run by hand; the Prefect tasks are stood in
for here."""

from rstar2.core import checkpoint, config
from rstar2.flows import train_stage


def test_due_steps_without_their_evaluation_are_evaluated_from_their_checkpoint(tmp_path, monkeypatch):
    cfg = config.load("tiny", ["eval.every=2"])
    stage = cfg.stages[0]
    committed = []
    for step in (1, 2, 3, 4):
        meta = {"run": "r", "preset": "tiny", "stage": stage.name, "step": step, "global_step": step}
        committed.append(checkpoint.commit(tmp_path / f"step-{step:04d}", lambda d: None, meta))
    rows = [{"step": 1}, {"step": 2, "eval_pass1": 0.5}, {"step": 3}, {"step": 4}]  # step 4 died before its eval
    loaded, evaluated = [], []
    monkeypatch.setattr(train_stage.rl, "load_weights", lambda run, d: loaded.append(d))
    monkeypatch.setattr(train_stage, "step_eval", lambda cfg, run, stage, ckpt, meta: evaluated.append(
        (ckpt, meta["step"], meta["global_step"])) or {"eval_pass1": 0.75})
    train_stage._redo_step_evals(cfg, None, stage, rows, committed)
    assert evaluated == [(str(committed[3]), 4, 4)] and rows[3]["eval_pass1"] == 0.75 and "eval_pass1" not in rows[2]
    # its checkpoint to evaluate, then the last for the next step
    assert loaded == [str(committed[3]), str(committed[3])]
    train_stage._redo_step_evals(cfg, None, stage, rows, committed)
    assert len(evaluated) == 1  # nothing left to redo
    train_stage._redo_step_evals(config.load("tiny"), None, stage, [{"step": 1}], committed[:1])  # eval.every 0
    assert len(evaluated) == 1
