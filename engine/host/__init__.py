"""What the engine takes of the machine it runs on: the heartbeat in shared memory, the C
allocator, CPU threads, the compiled CPU ops and the on-disk cache folder."""
