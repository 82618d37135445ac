package loader

//go:generate go tool bpf2go -tags linux -target bpfel -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I/usr/include/x86_64-linux-gnu" -type datapath_config -type rule_key -type rule -type rule_meta -type rule_state -type counters -type hist -type refusal -type sample -type iter_rec -type shape -type counter -type global_counter -type sample_kind egressd ../../bpf/egressd.c
