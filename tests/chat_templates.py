# ruff: noqa: E501
"""Small chat templates in the style of each tool-calling family, for the tiny test models (whose
tokenizers are trained on the spot and carry no template). Written for these tests; each writes the
markers its family's real template writes."""

HERMES = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>{% for t in tools %}{{ t.function.name }}: {{ t.function.parameters.properties | tojson }}
{% endfor %}</tools>
Call a tool with <tool_call>
{"name": <name>, "arguments": <args>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages if m.role != 'system' %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}
{% if m.role == 'tool' %}<tool_response>
{{ m.content }}
</tool_response>{% else %}{{ m.content }}{% endif %}
{%- for c in m.tool_calls or [] %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Qwen3-style: the same, and the model may open its turn with a <think> block.
HERMES_THINKING = HERMES.replace("Call a tool with", "Think inside <think></think> first. Call a tool with")

LLAMA3 = """{{ bos_token }}{%- for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>

{% if loop.last and tools %}Respond with {"name": function name, "parameters": dictionary of arguments}.
{% for t in tools %}{{ t.function.name }}: {{ t.function.parameters.properties | tojson }}
{% endfor %}{% endif %}{{ m.content }}
{%- for c in m.tool_calls or [] %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}
{%- endfor %}<|eot_id|>{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """{{ bos_token }}{%- if tools %}[AVAILABLE_TOOLS]{% for t in tools %}{{ t.function.name }}: {{ t.function.parameters.properties | tojson }} {% endfor %}[/AVAILABLE_TOOLS]{% endif %}
{%- for m in messages %}{% if m.role == 'user' or m.role == 'system' %}[INST]{{ m.content }}[/INST]
{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{%- else %}{{ m.content }}{% if m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]{% endif %}{{ eos_token }}{% endif %}{% endfor %}"""
