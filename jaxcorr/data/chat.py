"""A model's own chat template (the Jinja string in its
tokenizer_config.json) rendered the way `transformers`' `apply_chat_template`
renders it (`ChatTemplate`), and `chat_prompt_template`, which turns it into
the trainer's `config.data.prompt_template` (a `str.format` string with one
`{prompt}` field) so that every RL prompt is the model's own chat turn.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any


class ChatTemplate:
  """A Jinja chat template, rendered like transformers' `apply_chat_template`
  (sandboxed environment, `trim_blocks` and `lstrip_blocks`, the special
  tokens as variables, `raise_exception` for the template's own checks)."""

  def __init__(self, template: str, **special_tokens: str | None):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
      raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals['raise_exception'] = raise_exception
    env.filters['tojson'] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
    self.source = template
    self._template = env.from_string(template)
    self._tokens = {k: v for k, v in special_tokens.items() if v is not None}

  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> ChatTemplate:
    """The template of a HF checkpoint directory (tokenizer_config.json)."""
    file = os.path.join(os.fspath(path), 'tokenizer_config.json')
    if not os.path.isfile(file):
      raise FileNotFoundError(f'no tokenizer_config.json in {path!r}')
    with open(file) as f:
      cfg = json.load(f)
    template = cfg.get('chat_template')
    if isinstance(template, list):  # [{'name': 'default', 'template': ...}]
      template = {t['name']: t['template'] for t in template}.get('default')
    if not isinstance(template, str):
      raise ValueError(f'{file}: no chat_template string')

    def text(key: str) -> str | None:
      tok = cfg.get(key)
      return tok.get('content') if isinstance(tok, Mapping) else tok

    return cls(
      template,
      bos_token=text('bos_token'),
      eos_token=text('eos_token'),
      pad_token=text('pad_token'),
      unk_token=text('unk_token'),
    )

  def render(
    self,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
  ) -> str:
    """The conversation as the model's prompt text."""
    return self._template.render(
      messages=list(messages),
      add_generation_prompt=add_generation_prompt,
      **self._tokens,
    )

  def prompt_template(
    self,
    system: str | None = None,
    content: str = '{prompt}',
    examples: Sequence[tuple[str, str]] = (),
  ) -> str:
    """A `config.data.prompt_template`: one user turn (after an optional
    system turn) whose content is `content` (a text holding `{prompt}` once,
    e.g. 'What is {prompt}'), plus the generation prompt. `examples`:
    (user, assistant) demonstration turns placed before it (few-shot: a
    small model copies an answer format it is shown, not one described).

    The template is rendered with a marker as the content and the marker
    replaced by `{prompt}` (other braces doubled). A template that edits
    the content (strips or escapes it) would break that equivalence, so it
    is checked on two contents and refused when they disagree.
    """
    if content.count('{prompt}') != 1 or content.count('{') != 1:
      raise ValueError(
        f'content: invalid value {content!r}; allowed: a text with one '
        "'{prompt}' and no other braces"
      )
    marker = '\x00PROMPT\x00'
    out = self._turn(system, content.replace('{prompt}', marker), examples)
    if out.count(marker) != 1:
      raise ValueError(
        'the chat template does not copy the user content verbatim; write '
        'config.data.prompt_template by hand'
      )
    fmt = out.replace('{', '{{').replace('}', '}}').replace(marker, '{prompt}')
    probe = ' 12 + {x} =\n?'
    direct = self._turn(system, content.replace('{prompt}', probe), examples)
    if fmt.format(prompt=probe) != direct:
      raise ValueError(
        'the chat template renders contents differently; write '
        'config.data.prompt_template by hand'
      )
    return fmt

  def _turn(
    self,
    system: str | None,
    content: str,
    examples: Sequence[tuple[str, str]] = (),
  ) -> str:
    messages = [] if system is None else [{'role': 'system', 'content': system}]
    for user, assistant in examples:
      messages.append({'role': 'user', 'content': user})
      messages.append({'role': 'assistant', 'content': assistant})
    messages.append({'role': 'user', 'content': content})
    return self.render(messages, add_generation_prompt=True)


def chat_prompt_template(
  path: str | os.PathLike,
  system: str | None = None,
  content: str = '{prompt}',
  examples: Sequence[tuple[str, str]] = (),
) -> str:
  """`ChatTemplate.from_dir(path).prompt_template(system, content,
  examples)`."""
  return ChatTemplate.from_dir(path).prompt_template(system, content, examples)
