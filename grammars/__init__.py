"""Lark grammars shipped with asyncpage, usable by name: SamplingParams(grammar="sql_select")."""
