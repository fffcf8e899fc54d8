package pahostore

import (
	"testing"

	"github.com/eclipse/paho.mqtt.golang/packets"
)

func TestGetReturnsACopyOfAPublish(t *testing.T) {
	s := New()
	s.Open()
	defer s.Close()
	p := packets.NewControlPacket(packets.Publish).(*packets.PublishPacket)
	p.Qos, p.MessageID, p.TopicName, p.Payload = 1, 7, "a/b", []byte("x")
	s.Put("o.7", p)

	got := s.Get("o.7").(*packets.PublishPacket)
	if got == p {
		t.Fatal("Get returned the stored packet itself; want a copy")
	}
	got.Dup = true
	if p.Dup {
		t.Error("setting Dup on the copy changed the stored packet")
	}
	if got.TopicName != "a/b" || got.MessageID != 7 || string(got.Payload) != "x" {
		t.Errorf("copy = %+v; want the stored packet's content", got)
	}
	if s.Get("o.8") != nil {
		t.Error("Get of a missing key = non-nil")
	}
	sub := packets.NewControlPacket(packets.Subscribe)
	s.Put("o.9", sub)
	if s.Get("o.9") != sub {
		t.Error("non-PUBLISH packets are returned as stored")
	}
}
