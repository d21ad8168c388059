"""How the front reaches its engine core(s): in this process or a spawned one, the supervisor that
keeps it, and with data parallel the router, placement and global fair share over N cores."""
