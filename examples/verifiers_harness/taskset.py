"""A verifiers v1 taskset: 8 arithmetic questions, graded on the model's last reply.

verifiers finds it by id: `vf.SingleAgentEnvConfig(taskset={"id": "taskset"})` imports the module
`taskset` (this file, with its folder on PYTHONPATH) and takes the `vf.Taskset` subclass its
`__all__` exports. Imported only by driver.py, in the verifiers venv.

Rewards (verifiers sums them, weighted, into `trace.reward`):
  correct (weight 1.0)  the last number in the reply is the answer
  digits  (weight 0.1)  the share of the reply's non-space characters that are digits: a small
                        shaping term, so that a group of an untrained model's replies still
                        differs in reward and the update has an advantage to follow
"""

import re

import verifiers.v1 as vf

QUESTIONS = [("What is 2+3?", "5"), ("What is 4+4?", "8"), ("What is 9-7?", "2"), ("What is 3*3?", "9"),
             ("What is 10-4?", "6"), ("What is 1+6?", "7"), ("What is 12/3?", "4"), ("What is 5-4?", "1")]
SYSTEM = "Answer with the number only."
_NUMBER = re.compile(r"-?\d+")


class ArithData(vf.TaskData):
    answer: str = ""


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        numbers = _NUMBER.findall(trace.last_reply or "")
        return float(bool(numbers) and numbers[-1] == task.answer)

    @vf.reward(weight=0.1)
    async def digits(self, task: ArithData, trace: vf.Trace) -> float:
        text = "".join((trace.last_reply or "").split())
        return sum(c.isdigit() for c in text) / len(text) if text else 0.0


class ArithTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
    def load(self):
        for question, answer in QUESTIONS:
            yield ArithTask(ArithData(prompt=question, answer=answer, system_prompt=SYSTEM))


__all__ = ["ArithTaskset"]
