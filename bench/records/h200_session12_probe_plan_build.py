import torch, time
op = torch.ops.aten._scaled_dot_product_cudnn_attention
H,HKV,D=16,8,128
def call(S, hkv=HKV, T=None):
    T = T or S
    q=torch.randn(T,H,D,device='cuda',dtype=torch.bfloat16); k=torch.randn(T,hkv,D,device='cuda',dtype=torch.bfloat16); v=torch.randn_like(k)
    qv=q[:S].unsqueeze(0).transpose(1,2); kv=k[:S].unsqueeze(0).transpose(1,2); vv=v[:S].unsqueeze(0).transpose(1,2)
    torch.cuda.synchronize(); t=time.perf_counter()
    o=op(qv,kv,vv,None,False,0.0,True,False,scale=D**-0.5)[0]
    torch.cuda.synchronize(); t1=(time.perf_counter()-t)*1e3
    t=time.perf_counter()
    o=op(qv,kv,vv,None,False,0.0,True,False,scale=D**-0.5)[0]
    torch.cuda.synchronize(); t2=(time.perf_counter()-t)*1e3
    return t1,t2,o
try:
    t1,t2,o=call(1000); print("gqa dense ok", tuple(o.shape), o.stride())
except Exception as e: print("gqa dense FAIL", str(e)[:200])
for S in (1000, 1001, 2048, 3000, 4096, 5000, 6999, 7000, 7168, 8192, 256, 512):
    try:
        t1,t2,o=call(S, T=S+100)
        print(f"S={S} first {t1:.2f} ms, second {t2:.3f} ms", flush=True)
    except Exception as e: print(S,"FAIL",str(e)[:200])
# correctness vs reference with padding trick
S,Sp=1000,1024
q=torch.randn(Sp,H,D,device='cuda',dtype=torch.bfloat16); k=torch.randn(Sp,HKV,D,device='cuda',dtype=torch.bfloat16); v=torch.randn_like(k)
k[S:]=0; v[S:]=0; q[S:]=float('nan')
o=op(q.unsqueeze(0).transpose(1,2),k.unsqueeze(0).transpose(1,2),v.unsqueeze(0).transpose(1,2),None,False,0.0,True,False,scale=D**-0.5)[0]
ref=torch.nn.functional.scaled_dot_product_attention(q[:S].float().transpose(0,1),k[:S].float().repeat_interleave(2,1).transpose(0,1),v[:S].float().repeat_interleave(2,1).transpose(0,1),is_causal=True)
print("pad err", ((o[0,:,:S].float()-ref).norm()/ref.norm()).item(), "nan in real rows", torch.isnan(o[0,:,:S]).any().item())
