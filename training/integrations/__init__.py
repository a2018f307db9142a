"""Framework integrations: Hugging Face Trainer and Accelerate (``skyresume[hf]``),
Lightning (``skyresume[lightning]``). Each keeps the framework's own loop and
checkpoint format and adds what ``training.Run`` gives a script of its own (see
``docs/integrations.md``).

| module | does I/O | what |
| --- | --- | --- |
| ``session`` | step dirs, the store, UDP | ``FrameworkRun``: agreements, reports, commits, resume |
| ``hf`` | through ``session`` | ``train(trainer)`` and ``SkyresumeCallback`` |
| ``accelerate`` | through ``session`` | ``AccelerateRun``: ``save_state``/``load_state`` loops |
| ``lightning`` | through ``session`` | ``fit(trainer, model)`` and ``SkyresumeCallback`` |

Nothing here is imported by the service or the agent, and this package imports no
framework itself: each module imports its own, with an error naming the extra.
"""
