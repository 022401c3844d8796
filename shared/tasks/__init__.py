"""The built-in tasks' pieces that more than one service uses: the recall task's words, rows and reward (its env,
its dataset generator and the tiny test model), where a response holds its answer (the agents and the rewards)."""
