"""An example plug-in policy: shortest prompt first, with long prompts' rank scaled by a knob.

    cbjax scheduler.policy_class=example_policy:ShortestPromptFirst \\
        +scheduler.policy_args.long_prompt=256 +scheduler.policy_args.penalty=4
(run from experiments/, or with experiments/ on PYTHONPATH)
"""

from cbjax.scheduler.policies import RankedPolicy


class ShortestPromptFirst(RankedPolicy):
    """Lower rank is served first; ties and preempted requests behave as in fcfs."""

    name = "shortest_prompt"

    def __init__(self, cfg, long_prompt: int = 512, penalty: float = 2.0):
        super().__init__(cfg)
        self.long_prompt, self.penalty = long_prompt, penalty

    def rank(self, request):
        scale = self.penalty if request.prompt_len > self.long_prompt else 1.0
        return request.prompt_len * scale
