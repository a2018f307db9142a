"""The readers that take numbers out of a log (loss values, step times, per-rank
figures), on real excerpts. Each case quotes the thread it comes from."""

from __future__ import annotations

from orchestrator.domain import failures
from orchestrator.domain.failures import FailureClass, classify_failure

F = FailureClass

# https://github.com/BVLC/caffe/issues/6373 (times and pid cut): a healthy GoogLeNet
# test pass. Its layer names end in digits (loss1/, loss2/, loss3/), which once read as
# loss values 1, 2, 3: a rising loss, so a healthy log was called a loss spike.
CAFFE_GOOGLENET = """\
I0427 solver.cpp:330] Iteration 3000, Testing net (#0)
I0427 solver.cpp:397]     Test net output #0: loss1/loss1 = 0.286547 (* 0.3 = 0.0859641 loss)
I0427 solver.cpp:397]     Test net output #1: loss1/top-1 = 0.8822
I0427 solver.cpp:397]     Test net output #2: loss1/top-5 = 1
I0427 solver.cpp:397]     Test net output #3: loss2/loss2 = 0.245257 (* 0.3 = 0.0735772 loss)
I0427 solver.cpp:397]     Test net output #4: loss2/top-1 = 0.9106
I0427 solver.cpp:397]     Test net output #5: loss2/top-5 = 1
I0427 solver.cpp:397]     Test net output #6: loss3/loss3 = 0.247474 (* 1 = 0.247474 loss)
I0427 solver.cpp:397]     Test net output #7: loss3/top-1 = 0.9138
I0427 solver.cpp:397]     Test net output #8: loss3/top-5 = 1
"""


def _series(text: str) -> dict[str, list[float]]:
    lines = failures.log_lines(text)
    return {k: [v for v, _ in pts] for k, pts in failures._loss_series(lines).items()}


def test_a_digit_glued_to_loss_is_part_of_the_name_not_a_value() -> None:
    assert _series(CAFFE_GOOGLENET) == {
        "loss1/loss1": [0.286547],
        "loss2/loss2": [0.245257],
        "loss3/loss3": [0.247474],
    }


def test_layer_names_ending_in_digits_are_not_a_rising_loss() -> None:
    c = classify_failure(None, None, CAFFE_GOOGLENET, model_fallback=False)
    assert c.failure_class is not F.LOSS_SPIKE, c.evidence


def test_the_loss_wordings_the_reader_was_built_for_still_read() -> None:
    lines = [
        "loss: 1.23",
        "Total loss: 0.5",
        "lm loss: 2.3E+00",
        "{'loss': 0.4, 'grad_norm': 201.18}",
        "step_78540:\tloss_-4.065555573",
        "loss_rpn_cls: 0.4217, loss: 1.6328",
        "val_loss=tensor(0.5)",
        "loss2 0.7",
    ]
    got = [_series(line) for line in lines]
    assert got == [
        {"loss": [1.23]},
        {"total loss": [0.5]},
        {"lm loss": [2.3]},
        {"loss": [0.4]},
        {"loss": [-4.065555573]},
        {"loss_rpn_cls": [0.4217], "loss": [1.6328]},
        {"val_loss": [0.5]},
        {"loss2": [0.7]},
    ]
