from qrl.cli import main

main(prog_name="qrl")
