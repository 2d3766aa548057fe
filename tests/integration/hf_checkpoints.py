"""Tiny random checkpoints written by transformers itself, each with a tokenizer and its family's real
chat template, and transformers' own greedy answer to compare a served one with.

:func:`write_checkpoint` builds a transformers model (Qwen2, Qwen3, Mistral, Llama) from a small
config, randomizes its norms and biases (transformers makes them ones and zeros, which would hide a
norm or a bias the server forgot), saves it with ``save_pretrained`` (safetensors), and adds a
byte-level BPE tokenizer over printable ASCII (every token whole text, so streamed text never holds
part of a character) with the family's special tokens and chat template in ``tokenizer_config.json``:
the layout ``AutoTokenizer.from_pretrained`` and ``quicserve serve --model DIR`` both read.
:func:`hf_greedy` is transformers' answer: its tokenizer's chat template, then ``generate``.

The templates are the families' published ones (Qwen2.5-Instruct, Qwen3, Mistral-7B-Instruct-v0.1):
a server that renders one differently tokenizes another prompt, and its answer differs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["TEMPLATES", "SPECIALS", "write_checkpoint", "hf_greedy"]

QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

_QWEN = dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|im_end|>",
             pad="<|endoftext|>")
SPECIALS: dict[str, dict[str, Any]] = {  # model_type -> special tokens and the tokenizer_config names
    "qwen2": dict(_QWEN, template=QWEN25_TEMPLATE, added=[]),
    "qwen3": dict(_QWEN, template=QWEN3_TEMPLATE, added=["<think>", "</think>"]),
    "mistral": dict(specials=["<unk>", "<s>", "</s>"], bos="<s>", eos="</s>", pad=None, template=MISTRAL_TEMPLATE,
                    added=[]),
}
TEMPLATES = {k: v["template"] for k, v in SPECIALS.items()}
_CORPUS = ["You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
           "the quick brown fox jumps over the lazy dog; how many legs does a spider have?",
           "user assistant system tool_call tool_response think: 0123456789 [INST] [/INST]"]


def _tokenizer(path: Path, model_type: str) -> int:
    """tokenizer.json + tokenizer_config.json for ``model_type``; returns the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    fam = SPECIALS[model_type]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]  # GPT-2's byte map: space, newline
    trainer = trainers.BpeTrainer(vocab_size=260, initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                  special_tokens=fam["specials"])
    tok.train_from_iterator(_CORPUS * 20, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fam["added"]])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": fam["template"], "bos_token": fam["bos"],
        "eos_token": fam["eos"], "pad_token": fam["pad"], "model_max_length": 4096}))
    return int(tok.get_vocab_size(with_added_tokens=True))


def write_checkpoint(path: Path, model_type: str, config: Mapping[str, Any], *, seed: int = 0) -> Any:
    """A random ``model_type`` checkpoint with ``config`` (its vocabulary is the tokenizer's) in ``path``;
    returns the transformers model (float32, eval mode)."""
    import torch
    import transformers

    classes = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}
    config_class, model_class = classes[model_type]
    path.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(path, model_type)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(path / "tokenizer.json"))
    eos = ids.token_to_id(SPECIALS[model_type]["eos"])
    torch.manual_seed(seed)
    hf = model_class(config_class(**{**config, "vocab_size": vocab, "eos_token_id": eos})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if name.endswith("bias") else 1.0))
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def hf_greedy(hf: Any, path: Path, messages: Sequence[Mapping[str, Any]], max_new_tokens: int) -> tuple[list[int],
                                                                                                       list[int]]:
    """transformers' greedy answer to a chat: (the prompt's ids by its chat template, the new token ids),
    every one of ``max_new_tokens`` (no end-of-sequence stop)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    prompt = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(prompt, Mapping):  # some versions return a BatchEncoding whatever return_dict says
        prompt = prompt["input_ids"]
    prompt = [int(t) for t in prompt]
    hf.generation_config.eos_token_id = None  # as the server with ignore_eos: an eos is a token like any
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    return prompt, out[0, len(prompt):].tolist()
