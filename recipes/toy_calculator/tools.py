"""verl function tools of the toy_calculator environment (``rollout.multi_turn.function_tool_path``)."""

from verl.tools.function_tool import function_tool

from scripts.experiments.toy_tasks.calculator import calculator

function_tool("calculator")(calculator)
