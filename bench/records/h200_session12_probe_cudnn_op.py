import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
op=torch.ops.aten._scaled_dot_product_cudnn_attention
def t(fn,n=10):
    fn(); torch.cuda.synchronize(); s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True)
    s.record(); [fn() for _ in range(n)]; e.record(); torch.cuda.synchronize(); return s.elapsed_time(e)/n*1e3
for S in (7000, 7168):
    fl=4*16*128*S*(S+1)/2
    q=torch.randn(1,16,S,128,device='cuda',dtype=torch.bfloat16); k=torch.randn(1,8,S,128,device='cuda',dtype=torch.bfloat16); v=torch.randn_like(k)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        u=t(lambda: F.scaled_dot_product_attention(q,k,v,is_causal=True,enable_gqa=True)); print(S,"sdpa gqa",round(u),"us",round(fl/u/1e6))
    u=t(lambda: op(q,k,v,None,False,0.0,True,False,scale=128**-0.5)); print(S,"op gqa",round(u),"us",round(fl/u/1e6))
    kr,vr=k.repeat_interleave(2,1),v.repeat_interleave(2,1)
    u=t(lambda: op(q,kr,vr,None,False,0.0,True,False,scale=128**-0.5)); print(S,"op rep",round(u),"us",round(fl/u/1e6))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        u=t(lambda: F.scaled_dot_product_attention(q,kr,vr,is_causal=True)); print(S,"sdpa rep",round(u),"us",round(fl/u/1e6))
