"""The actor worker's loss: installed in verl's actor with set_loss_fn; on-policy policy losses."""
