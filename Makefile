# Shortcuts for the README's two commands.
.PHONY: run test setup
setup:
	bash .ci/setup.sh
run: setup
	.venv/bin/python -m mgpu train --num-gpus 2 --batch-size 256 --lr 0.2 --epochs 10
test:
	bash .ci/test.sh
