"""Time, cost and the plan: FLOPs and bytes of a step, a roofline per GPU, communication,
step time and cost (performance), and the planner that searches GPUs and techniques.

No torch here: everything is computed from the Job and the model's Architecture.
"""
