#!/usr/bin/env bash
# Speed before (main 47c1216) and after (house-merge), alternating, same machine, same load.
set -u
source /work/main/.venv/bin/activate
OUT=/tmp/speed; mkdir -p $OUT
for round in 1 2; do
for label in before after; do
  tree=/work/wt/old; [ $label = after ] && tree=/work/wt/merge
  cd $tree
  PYTHONPATH=$tree timeout 900 python benchmarks/kernel_throughput.py --sizes 20000 --classes 1 10 --paths fused chunked --repeats 3 --out $OUT/kt_${label}_$round.json > $OUT/kt_${label}_$round.log 2>&1
  PYTHONPATH=$tree timeout 900 python benchmarks/outside_products.py --n-train 3000 --steps 5 --chunked-steps 2 --label $label --out $OUT/op_${label}_$round.json > $OUT/op_${label}_$round.log 2>&1
  PYTHONPATH=$tree timeout 900 python benchmarks/distributed.py --num-data 5000 --products 3 --steps 2 --out $OUT/dist_${label}_$round > $OUT/dist_${label}_$round.log 2>&1
done
done
echo done
