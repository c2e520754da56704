"""`TurnFormat`: token ids of a conversation's turns from its chat template,
appended without ever re-encoding the history.

The prompt is the template's rendering of the opening messages (with the
generation prompt), encoded once. After an agent turn, the environment's
new messages enter the sequence as the template's *delta* for them: the
text a rendering of the conversation gains when they are appended. It is
computed on a fixed placeholder conversation (a user turn and an assistant
turn), as verl and SkyRL do, so the agent's own text is never rendered or
re-tokenized::

    closed = render([user 'U', assistant 'A'], add_generation_prompt=False)
    full   = render([user 'U', assistant 'A', *new], add_generation_prompt=True)
    delta  = tail + full[len(closed):]

where `tail` is what the template writes after an assistant message's
content (SmolLM2: '<|im_end|>\\n'). The delta is encoded without BOS; when
its first id is the token that ended the agent's turn (the agent sampled
'<|im_end|>' itself), that id is dropped, since it is in the sequence
already. A template whose rendering of the earlier turns changes when a
message is appended (one that rewrites past turns) has no such delta and
is refused (`ValueError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxcorr.data.chat import ChatTemplate

_USER, _AGENT = 'USER_TURN_MARK', 'AGENT_TURN_MARK'


class TurnFormat:
  """Prompt ids and environment deltas of one chat template.

  Args:
    template: the model's chat template.
    tokenizer: `encode(text, bos=...) -> ids` (`jaxcorr.data.text`).
  """

  def __init__(self, template: ChatTemplate, tokenizer: Any):
    self.template, self.tokenizer = template, tokenizer
    self._base = [
      {'role': 'user', 'content': _USER},
      {'role': 'assistant', 'content': _AGENT},
    ]
    closed = template.render(self._base, add_generation_prompt=False)
    if closed.count(_AGENT) != 1:
      raise ValueError(
        'the chat template does not copy an assistant message verbatim: no '
        'turn delta can be computed'
      )
    self._closed = closed
    self.tail = closed[closed.index(_AGENT) + len(_AGENT) :]

  def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
    """The opening messages and the generation prompt, with BOS."""
    text = self.template.render(messages, add_generation_prompt=True)
    return list(self.tokenizer.encode(text, bos=True))

  def delta_text(self, messages: Sequence[dict]) -> str:
    """The text that follows an agent turn's content when `messages` are
    appended, through the next generation prompt."""
    full = self.template.render(
      [*self._base, *messages], add_generation_prompt=True
    )
    if not full.startswith(self._closed):
      raise ValueError(
        'the chat template renders earlier turns differently once a '
        f'message is appended ({[m.get("role") for m in messages]}): '
        'token-in/token-out trajectories need a prefix-stable template'
      )
    return self.tail + full[len(self._closed) :]

  def env_ids(
    self, messages: Sequence[dict], last_agent_token: int | None
  ) -> list[int]:
    """The delta of `messages` as ids (module docstring)."""
    ids = list(self.tokenizer.encode(self.delta_text(messages), bos=False))
    if ids and last_agent_token is not None and ids[0] == last_agent_token:
      ids = ids[1:]
    return ids


ARITH_TOOL_TEMPLATE = (
  '{% for m in messages %}'
  "{% if m.role == 'user' %}{{ 'Q: ' + m.content + '?\\n' }}"
  "{% elif m.role == 'assistant' %}{{ 'A: ' + m.content + '\\n' }}"
  "{% elif m.role == 'tool' %}{{ '= ' + m.content + '\\n' }}"
  '{% endif %}{% endfor %}'
  "{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}"
)
"""A chat template in the arithmetic character vocabulary
(`jaxcorr.data.tasks.CharTokenizer`): 'Q: 17*25=?\\nA: ' opens, a tool
result reads '= 425\\n' (configs/arith_tool.py)."""
