from meshtron.cli import run

run()
