"""The toy tasks (task definition, reward) behind the toy recipes and the experiments."""
