"""The run's set-up and closing report (train.run)."""

from phalanx.train.run import describe_eval
from phalanx.train.state import TrainerState


def test_the_closing_line_says_when_no_evaluation_ran():
    state = TrainerState()
    assert describe_eval(state) == "no evaluation (no eval rows: the data summary above says where they went)"
    state.last_eval_loss, state.best_eval_loss, state.best_step = 1.23456, 1.1, 4
    assert describe_eval(state) == "eval loss 1.2346 (best 1.1000 at step 4)"
