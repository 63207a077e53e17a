"""`python -m fragments.ranks DIR --tp N [--listen 127.0.0.1:PORT]`: a session's ranks kept up for other processes
to attach to (fragments.session.host says how)."""
import sys

from .session.host import main

if __name__ == "__main__":
    sys.exit(main())
