"""``evaluate`` modules of this project, loaded by path (no hub access)::

    import evaluate
    from eval.metrics import CODE_EVAL_SANDBOXED
    code_eval = evaluate.load(CODE_EVAL_SANDBOXED)      # a drop-in for evaluate's "code_eval"
"""
import os

CODE_EVAL_SANDBOXED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_eval_sandboxed")
