"""Records, datasets, chat rendering and the batch types exchanged between stages."""
